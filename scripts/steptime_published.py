"""The plan's roofline step time (``megatron_bridge_ext.levers.steptime``) against published throughput costs.

    python scripts/steptime_published.py [--gpu h100]

Each published figure (``megatron_bridge_ext.evidence``) is a throughput change measured on H100; the
prediction is the step-time change of the same lever on the same layout, from the model's
config.json shapes and the preset's datasheet rates, nothing fitted. A throughput change p is a
step-time change 1/(1 + p) - 1. What the publications do not state is assumed, and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_bridge_ext import evidence  # noqa: E402
from megatron_bridge_ext.levers import steptime  # noqa: E402

LLAMA3_70B = os.path.join(ROOT, "tests", "data", "llama-3-70b", "config.json")
QWEN3_8B = os.path.join(ROOT, "tests", "data", "qwen3-8b", "config.json")
LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def settings(path: str, *, tp: int, pp: int, vpp, dp: int, seq: int, global_batch: int, sp: bool,
             peft: bool = False, recompute=(), strategy: str = "off") -> dict:
    """The estimate's settings keys the step time reads, from a config.json and a layout (no estimate run)."""
    with open(path) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    return {"tp": tp, "pp": pp, "vpp": vpp, "cp": 1, "dp": dp, "sequence_parallel": sp and tp > 1,
            "seq_length": seq, "micro_batch": 1, "num_microbatches": global_batch // dp, "dtype": "bfloat16",
            "stage": pp - 1, "layers_on_stage": c["num_hidden_layers"] // pp, "hidden": c["hidden_size"],
            "ffn": c["intermediate_size"], "heads": heads, "query_groups": c.get("num_key_value_heads") or heads,
            "kv_channels": c.get("head_dim") or c["hidden_size"] // heads, "num_layers": c["num_hidden_layers"],
            "gated_linear_unit": True, "vocab_size": c["vocab_size"],
            "recompute_granularity": "selective" if recompute else None, "recompute_modules": list(recompute),
            "distributed_optimizer": True, "peft": "LoRA" if peft else None, "lora_dim": 32,
            "lora_targets": LORA_TARGETS, "sequence_parallel_input_strategy": strategy}


def throughput_as_time(pct: float) -> float:
    return 100.0 * (1.0 / (1.0 + pct / 100.0) - 1.0)


def cases():
    """(case, published throughput change %, source, settings before, settings after)."""
    llama = dict(seq=4096, global_batch=8, sp=False)
    base = settings(LLAMA3_70B, tp=4, pp=4, vpp=5, dp=2, **llama)
    qwen = dict(tp=2, pp=1, vpp=None, dp=4, seq=8192, global_batch=4, sp=True, peft=True)
    return [
        ("Llama 3 70B SFT, TP 4 -> 8 (DP 2 -> 1)", -28.4, evidence.TP_DOUBLING.source, base,
         settings(LLAMA3_70B, tp=8, pp=4, vpp=5, dp=1, **llama)),
        ("Llama 3 70B SFT, PP 4 -> 8 (DP 2 -> 1)", -5.9, evidence.PP_DOUBLING.source, base,
         settings(LLAMA3_70B, tp=4, pp=8, vpp=5, dp=1, **llama)),
        ("Llama 3 70B SFT, selective mlp recompute", -16.0, evidence.MLP_RECOMPUTE.source, base,
         settings(LLAMA3_70B, tp=4, pp=4, vpp=5, dp=2, recompute=["mlp"], **llama)),
        ("Qwen3-8B LoRA, LoRA-A input regather", -6.74, evidence.QWEN3_8B_REGATHER.source,
         settings(QWEN3_8B, **qwen), settings(QWEN3_8B, strategy="regather", **qwen)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100", choices=sorted(steptime.GPUS))
    device = steptime.gpu(parser.parse_args().gpu)
    print(f"device: {device.name} ({device.source})")
    print("assumed: Llama 3 70B: seq 4096, micro-batch 1, global batch 8 (Bridge's llama3_70b_sft recipe), SP off "
          "(the recipe's), distributed optimizer; Qwen3-8B: LoRA r32 on the four linears, seq 8192, micro-batch 1, "
          "DP 4, SP on")
    print("| case | published throughput | as step time | predicted step time | before (s) | after (s) | source |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, published, source, before, after in cases():
        t0, t1 = steptime.step_time(before, device), steptime.step_time(after, device)
        print(f"| {name} | {published:+.1f}% | {throughput_as_time(published):+.1f}% | "
              f"{steptime.change_pct(t0, t1):+.1f}% | {t0.total:.3f} | {t1.total:.3f} | {source} |")
        for label, t in (("before", t0), ("after", t1)):
            terms = ", ".join(f"{k} {v:.3f}" for k, v in vars(t).items())
            print(f"|   {label}: {terms} | | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
