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
import datetime
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megatron_bridge_ext import evidence  # noqa: E402
from megatron_bridge_ext.levers import calibration, published, steptime  # noqa: E402

FITTED = ("GEMM_PEAK_FRACTION_BF16", "GEMM_PEAK_FRACTION_FP8", "GEMM_HALF_FLOPS")
SFT_70B = [("TP4 PP4 VPP5", dict(tp=4, pp=4, vpp=5, dp=2), 704.0), ("TP4 PP8 VPP5", dict(tp=4, pp=8, vpp=5, dp=1), 668.0),
           ("TP8 PP4 VPP5", dict(tp=8, pp=4, vpp=5, dp=1), 508.7)]
"""Llama 3 70B SFT on 32 H100, FP8, seq 4096, global batch 32 (the performance summary's SFT row), the layouts of
the Memory Tuning guide with their TFLOP/s/GPU (its -5.1% for PP 8, -27.7% for TP 8)."""


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
    by_gpu = collections.defaultdict(list)
    for r in rows:
        p = predicted_tflops(r)
        err = 100 * (p / r.published_tflops - 1)
        by_gpu[r.gpu].append(abs(err))
        print(f"| {r.label} | {r.published_tflops:.0f} | {p:.0f} | {err:+.1f}% |")
    print("\n| GPU | rows | median abs error | worst abs error |\n| --- | --- | --- | --- |")
    for g, errs in sorted(by_gpu.items()) + [("all", [e for v in by_gpu.values() for e in v])]:
        print(f"| {g} | {len(errs)} | {statistics.median(errs):.1f}% | {max(errs):.1f}% |")
    print(f"\nskipped {len(skipped)} rows:")
    for reason, n in collections.Counter(reason for _, reason in skipped).most_common():
        print(f"  {n:3d}  {reason}")
    print(f"\nLlama 3 70B SFT, 32x H100 ({evidence.MEMORY_TUNING_DOC}):")
    print("| layout | published TFLOP/s/GPU | predicted |\n| --- | --- | --- |")
    for name, figure, p in sft_70b():
        print(f"| {name} | {figure} | {p:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
