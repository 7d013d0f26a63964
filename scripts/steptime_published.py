"""The plan's step time (``megatron_bridge_ext.levers.steptime``) against NVIDIA's published throughput.

    PYTHONPATH=$PWD python scripts/steptime_published.py [--fit] [--csv PATH]

For every usable row of Megatron Bridge's performance summaries (``megatron_bridge_ext.levers.published``): the
published TFLOP/s/GPU and the predicted one (Bridge's model FLOPs per step / predicted step time / GPUs), the error,
the median and worst absolute error per GPU kind and overall; the skipped rows with their reasons; the published
layout comparison of Llama 3 70B SFT on 32 H100 and the lever changes ``megatron_bridge_ext.evidence`` cites.
``--fit`` refits the constants of ``megatron_bridge_ext.levers.calibration`` (least squares on the log error,
Nelder-Mead) and prints them before the table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megatron_bridge_ext import evidence  # noqa: E402
from megatron_bridge_ext.estimate.settings import (MoeSettings, PeftSettings,  # noqa: E402
                                                   Settings)
from megatron_bridge_ext.levers import calibration, published, steptime  # noqa: E402

FITTED = ("GEMM_PEAK_FRACTION_BF16", "GEMM_PEAK_FRACTION_FP8", "GEMM_HALF_FLOPS")
SFT_70B = [("TP4 PP4 VPP5", dict(tp=4, pp=4, vpp=5, dp=2), 704.0),
           ("TP4 PP8 VPP5", dict(tp=4, pp=8, vpp=5, dp=1), 668.0),
           ("TP8 PP4 VPP5", dict(tp=8, pp=4, vpp=5, dp=1), 508.7)]
"""Llama 3 70B SFT on 32 H100, FP8, seq 4096, global batch 32 (the performance summary's SFT row), the layouts of
the Memory Tuning guide with their TFLOP/s/GPU (its -5.1% for PP 8, -27.7% for TP 8)."""


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
    lora = PeftSettings("megatron.bridge.peft.lora.LoRA", "lora", 32, LORA_TARGETS, strategy) if peft else None
    shapes = published.settings(c, tp=tp, pp=pp, vpp=vpp, cp=1, dp=dp, seq=seq, mbs=1, gbs=global_batch, fp8=False,
                                recompute=recompute, sp=sp)
    # The lever comparisons below price TP's collectives unoverlapped, on an even pipeline split.
    return dataclasses.replace(shapes, peft=lora, tp_comm_overlap=False,
                               layers_on_stage=c["num_hidden_layers"] // pp)


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


def predicted_tflops(row: published.Row) -> float:
    t = steptime.step_time(row.settings, steptime.gpu(row.gpu), moe=row.moe)
    return row.step_flops / t.total / row.gpus / 1e12


def log_errors(rows) -> list[float]:
    return [math.log(predicted_tflops(r) / r.published_tflops) for r in rows]


def fit(rows) -> float:
    """Set the calibration constants to the least-squares fit of the log error; return its RMS."""
    from scipy.optimize import minimize

    start = [math.log(getattr(calibration, k)) for k in FITTED]

    def loss(x):
        for k, v in zip(FITTED, x):
            setattr(calibration, k, math.exp(v))
        return sum(e * e for e in log_errors(rows))

    best = minimize(loss, start, method="Nelder-Mead", options={"xatol": 1e-3, "fatol": 1e-6, "maxiter": 400})
    loss(best.x)
    return math.sqrt(best.fun / len(rows))


def sft_70b() -> list[tuple[str, float, float]]:
    """(layout, published, predicted TFLOP/s/GPU) of the three Llama 3 70B SFT layouts."""
    c = published.config("llama-3-70b")
    out = []
    for name, layout, figure in SFT_70B:
        s = published.settings(c, cp=1, seq=4096, mbs=1, gbs=32, fp8=True, **layout)
        t = steptime.step_time(s, steptime.gpu("h100"))
        out.append((name, figure, published.flops_per_token(c, 4096, layout["tp"]) * 32 * 4096 / t.total / 32 / 1e12))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the calibration constants and print them")
    parser.add_argument("--csv", default=published.SUMMARY)
    args = parser.parse_args()
    rows, skipped = published.rows(args.csv)
    if args.fit:
        rms = fit(rows)
        errs = [abs(100 * (math.exp(e) - 1)) for e in log_errors(rows)]
        print(f"# fit {datetime.date.today()} on {os.path.relpath(args.csv, ROOT)}: {len(rows)} rows, RMS log error "
              f"{rms:.3f}, median |error| {statistics.median(errs):.1f}%, worst {max(errs):.1f}%")
        for k in FITTED:
            print(f"{k} = {getattr(calibration, k):.4g}")
        print()
    print(f"constants: {', '.join(f'{k} {getattr(calibration, k):.4g}' for k in FITTED)} ({calibration.FIT})")
    print("| row | published TFLOP/s/GPU | predicted | error |")
    print("| --- | --- | --- | --- |")
    by_gpu, by_model = collections.defaultdict(list), collections.defaultdict(list)
    for r in rows:
        p = predicted_tflops(r)
        err = 100 * (p / r.published_tflops - 1)
        by_gpu[r.gpu].append(abs(err))
        by_model["MoE" if r.moe else "dense"].append(err)
        print(f"| {r.label} | {r.published_tflops:.0f} | {p:.0f} | {err:+.1f}% |")
    print("\n| GPU | rows | median abs error | worst abs error |\n| --- | --- | --- | --- |")
    for g, errs in sorted(by_gpu.items()) + [("all", [e for v in by_gpu.values() for e in v])]:
        print(f"| {g} | {len(errs)} | {statistics.median(errs):.1f}% | {max(errs):.1f}% |")
    for kind, errs in sorted(by_model.items()):
        print(f"{kind}: {len(errs)} rows, median error {statistics.median(errs):+.1f}% (signed), median abs "
              f"{statistics.median(abs(e) for e in errs):.1f}%")
    print(f"\nskipped {len(skipped)} rows:")
    for reason, n in collections.Counter(reason for _, reason in skipped).most_common():
        print(f"  {n:3d}  {reason}")
    print(f"\nLlama 3 70B SFT, 32x H100 ({evidence.MEMORY_TUNING_DOC}):")
    print("| layout | published TFLOP/s/GPU | predicted |\n| --- | --- | --- |")
    for name, figure, p in sft_70b():
        print(f"| {name} | {figure} | {p:.0f} |")
    levers()
    return 0


def levers() -> None:
    """The lever changes megatron_bridge_ext.evidence cites, predicted on H100 (their layouts as assumed below)."""
    device = steptime.gpu("h100")
    print("\nlever changes on H100; assumed: Llama 3 70B: seq 4096, micro-batch 1, global batch 8 (Bridge's "
          "llama3_70b_sft recipe), SP off (the recipe's), BF16; Qwen3-8B: LoRA r32 on the four linears, seq 8192, "
          "DP 4, SP on; Qwen3-30B-A3B and GPT-OSS-120B: the layouts of scripts/estimate_published.py; Mixtral 8x7B: "
          "8 GPUs, seq 4096, global batch 64, SP with TP, ETP = TP, all-to-all dispatcher, balanced routing")
    print("| case | published throughput | as step time | predicted step time | before (s) | after (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, figure, _, before, after, moe_before, moe_after in cases():
        t0, t1 = steptime.step_time(before, device, moe=moe_before), steptime.step_time(after, device, moe=moe_after)
        as_time = "slower" if figure is None else f"{throughput_as_time(figure):+.1f}%"
        figure = "slower" if figure is None else f"{figure:+.1f}%"
        print(f"| {name} | {figure} | {as_time} | {steptime.change_pct(t0, t1):+.1f}% | {t0.total:.3f} | "
              f"{t1.total:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
