"""The plan's roofline step time (``megatron_bridge_ext.levers.steptime``) against published throughput costs.

    PYTHONPATH=$PWD python scripts/steptime_published.py [--gpu h100]

Each published figure (``megatron_bridge_ext.evidence``) is a throughput change measured on H100; the
prediction is the step-time change of the same lever on the same layout, from the model's
config.json shapes and the preset's datasheet rates, nothing fitted. A throughput change p is a
step-time change 1/(1 + p) - 1. What the publications do not state is assumed, and printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megatron_bridge_ext import evidence  # noqa: E402
from megatron_bridge_ext.estimate.settings import (MoeSettings, PeftSettings, ReportSettings,  # noqa: E402
                                                   Settings)
from megatron_bridge_ext.levers import steptime  # noqa: E402

LLAMA3_70B = os.path.join(ROOT, "tests", "data", "llama-3-70b", "config.json")
QWEN3_8B = os.path.join(ROOT, "tests", "data", "qwen3-8b", "config.json")
MIXTRAL_8X7B = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "vocab_size": 32000}
"""Mixtral 8x7B's shapes (its Hugging Face config.json: 8 experts, top-2, every layer MoE)."""
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LATER_KEYS = {"fp8": None, "moe_shared_ffn": 0, "log_interval": 1, "train_iters": None,
              "cuda_graph_first_iteration": None, "wgrad_deferral_limit": None}
"""Settings keys the estimate gained after the committed JSONs were written, at what those runs had: no FP8, no
shared experts (GPT-OSS-120B and Qwen3-30B-A3B have none), Bridge's reporting defaults (the step time reads none)."""


def settings(path: str, *, tp: int, pp: int, vpp, dp: int, seq: int, global_batch: int, sp: bool,
             peft: bool = False, recompute=(), strategy: str = "off") -> Settings:
    """The estimate's settings the step time reads, from a config.json and a layout (no estimate run)."""
    if isinstance(path, dict):
        c = path
    else:
        with open(path) as f:
            c = json.load(f)
    heads = c["num_attention_heads"]
    lora = PeftSettings("megatron.bridge.peft.lora.LoRA", "lora", 32, LORA_TARGETS, strategy) if peft else None
    return Settings(tp=tp, pp=pp, vpp=vpp, cp=1, dp=dp, sequence_parallel=sp and tp > 1, seq_length=seq,
                    micro_batch=1, num_microbatches=global_batch // dp, dtype="bfloat16", fp8=None, stage=pp - 1,
                    layers_on_stage=c["num_hidden_layers"] // pp, hidden=c["hidden_size"], ffn=c["intermediate_size"],
                    heads=heads, query_groups=c.get("num_key_value_heads") or heads,
                    kv_channels=c.get("head_dim") or c["hidden_size"] // heads, num_layers=c["num_hidden_layers"],
                    gated_linear_unit=True, vocab_size=c["vocab_size"],
                    recompute_granularity="selective" if recompute else None, recompute_modules=tuple(recompute),
                    attention="fused", transformer_impl="transformer_engine", device="cuda",
                    distributed_optimizer=True, peft=lora, hybrid=None,
                    reports=ReportSettings(log_interval=1, train_iters=None, cuda_graph_first_iteration=None,
                                           wgrad_deferral_limit=None), moe=None)


def mixtral(ep: int, tp: int) -> tuple[Settings, dict]:
    """Mixtral 8x7B on 8 GPUs at sequence 4096, global batch 64, SP with TP, expert TP = TP, all-to-all dispatcher."""
    s = settings(MIXTRAL_8X7B, tp=tp, pp=1, vpp=None, dp=8 // tp, seq=4096, global_batch=64, sp=True)
    each = math.ceil(4096 // tp * 2 / 8)  # balanced: from one of the TP x EP source ranks to one local expert
    s = dataclasses.replace(s, moe=MoeSettings(
        experts=8, topk=2, ffn=14336, ep=ep, etp=tp, local_experts=8 // ep, dispatcher="alltoall", imbalance=1.0,
        layers_on_stage=s.layers_on_stage, routed_tokens_per_layer=each * tp * ep * (8 // ep), shared_ffn=0))
    moe = {"experts": 8, "topk": 2, "moe_ffn": 14336, "shared_ffn": 0, "ep": ep, "etp": tp, "dispatcher": "alltoall",
           "grouped_gemm": True, "pattern": [1] * 32}
    return s, moe


def moe_lora(name: str, strategy: str) -> tuple[Settings, dict]:
    """An MoE model's LoRA layout as ``scripts/estimate_published.py`` estimated it (the committed JSON's first
    record, Bridge's LoRA: TP, EP, DP, sequence, LoRA targets and rank), with the LoRA-A input ``strategy``."""
    with open(os.path.join(ROOT, "benchmarks", f"2026-12-01-{name}-lora-estimate.json")) as f:
        s = Settings.from_json({**LATER_KEYS, **json.load(f)[0]["estimate"]["settings"]})
    s = dataclasses.replace(s, peft=dataclasses.replace(s.peft, sequence_parallel_input_strategy=strategy))
    moe = {"experts": s.moe.experts, "topk": s.moe.topk, "moe_ffn": s.moe.ffn, "shared_ffn": s.moe.shared_ffn,
           "ep": s.moe.ep, "etp": s.moe.etp, "dispatcher": s.moe.dispatcher, "grouped_gemm": False,
           "pattern": [1] * s.num_layers}
    return s, moe


def regather_pair(name: str) -> tuple[Settings, Settings, dict, dict]:
    """Settings before and after regather, and the MoE shapes before and after (the same)."""
    (before, moe), (after, _) = moe_lora(name, "off"), moe_lora(name, "regather")
    return before, after, moe, moe


def throughput_as_time(pct: float) -> float:
    return 100.0 * (1.0 / (1.0 + pct / 100.0) - 1.0)


def cases():
    """(case, published throughput change % (None: a direction only), source, settings before, settings after,
    MoE shapes before and after)."""
    llama = dict(seq=4096, global_batch=8, sp=False)
    base = settings(LLAMA3_70B, tp=4, pp=4, vpp=5, dp=2, **llama)
    qwen = dict(tp=2, pp=1, vpp=None, dp=4, seq=8192, global_batch=4, sp=True, peft=True)
    ep8, ep4 = mixtral(8, 1), mixtral(4, 2)
    return [
        ("Llama 3 70B SFT, TP 4 -> 8 (DP 2 -> 1)", -28.4, evidence.TP_DOUBLING.source, base,
         settings(LLAMA3_70B, tp=8, pp=4, vpp=5, dp=1, **llama), None, None),
        ("Llama 3 70B SFT, PP 4 -> 8 (DP 2 -> 1)", -5.9, evidence.PP_DOUBLING.source, base,
         settings(LLAMA3_70B, tp=4, pp=8, vpp=5, dp=1, **llama), None, None),
        ("Llama 3 70B SFT, selective mlp recompute", -16.0, evidence.MLP_RECOMPUTE.source, base,
         settings(LLAMA3_70B, tp=4, pp=4, vpp=5, dp=2, recompute=["mlp"], **llama), None, None),
        ("Qwen3-8B LoRA, LoRA-A input regather", -6.74, evidence.QWEN3_8B_REGATHER.source,
         settings(QWEN3_8B, **qwen), settings(QWEN3_8B, strategy="regather", **qwen), None, None),
        ("Qwen3-30B-A3B LoRA (TP4 EP4), LoRA-A input regather", -2.89, evidence.MOE_REGATHER_SOURCE,
         *regather_pair("qwen3-30b-a3b")),
        ("GPT-OSS-120B LoRA (TP2 EP8), LoRA-A input regather", -0.34, evidence.MOE_REGATHER_SOURCE,
         *regather_pair("gpt-oss-120b")),
        ("Mixtral 8x7B, EP8 TP1 -> EP4 TP2 (slower, no figure)", None, evidence.EP_OVER_TP.source,
         ep8[0], ep4[0], ep8[1], ep4[1]),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100", choices=sorted(steptime.GPUS))
    device = steptime.gpu(parser.parse_args().gpu)
    print(f"device: {device.name} ({device.source})")
    print("assumed: Llama 3 70B: seq 4096, micro-batch 1, global batch 8 (Bridge's llama3_70b_sft recipe), SP off "
          "(the recipe's), distributed optimizer; Qwen3-8B: LoRA r32 on the four linears, seq 8192, micro-batch 1, "
          "DP 4, SP on; Qwen3-30B-A3B and GPT-OSS-120B: the layouts of scripts/estimate_published.py (its committed "
          "JSON: Bridge's recipe LoRA for Qwen3-30B-A3B, its default LoRA for GPT-OSS-120B, sequence 8192, DP 4); "
          "Mixtral 8x7B: 8 GPUs, seq 4096, micro-batch 1, global batch 64, full fine-tuning, SP with TP, "
          "ETP = TP, all-to-all dispatcher, balanced routing")
    print("| case | published throughput | as step time | predicted step time | before (s) | after (s) | source |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, published, source, before, after, moe_before, moe_after in cases():
        t0, t1 = steptime.step_time(before, device, moe=moe_before), steptime.step_time(after, device, moe=moe_after)
        as_time = "slower" if published is None else f"{throughput_as_time(published):+.1f}%"
        published = "slower" if published is None else f"{published:+.1f}%"
        print(f"| {name} | {published} | {as_time} | "
              f"{steptime.change_pct(t0, t1):+.1f}% | {t0.total:.3f} | {t1.total:.3f} | {source} |")
        for label, t in (("before", t0), ("after", t1)):
            terms = ", ".join(f"{k} {v:.3f}" for k, v in vars(t).items())
            print(f"|   {label}: {terms} | | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
