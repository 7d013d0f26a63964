"""The step-time model's free constants (:mod:`.steptime`), fitted to NVIDIA's published throughput.

Data: Megatron Bridge's ``docs/performance-summary.md`` and ``performance-summary-archive.md`` (NVIDIA-NeMo/
Megatron-Bridge, every release from NeMo container 25.09 to 26.08), one row per published layout with its measured
TFLOP/s/GPU, as ``tests/data/throughput/bridge_performance_summary.csv`` holds them (its README: the columns and
conventions). ``scripts/steptime_published.py --fit`` refits the constants below on that file and prints them; the
fit minimises the squared log error of predicted against published TFLOP/s/GPU (Nelder-Mead from the values here).

Everything else the step time reads is a datasheet rate or a shape: these three numbers are the only ones fitted.
"""

from __future__ import annotations

GEMM_PEAK_FRACTION_BF16 = 0.5134
"""The fraction of the BF16 dense peak a large GEMM (and the attention core) reaches."""
GEMM_PEAK_FRACTION_FP8 = 0.5082
"""The fraction of the FP8 dense peak a large FP8 GEMM reaches (scaling and casting kernels included)."""
GEMM_HALF_FLOPS = 1.251e11
"""Per-GPU FLOPs of one GEMM at which it reaches half its large-GEMM fraction: a GEMM of f FLOPs runs at
``fraction x f / (f + GEMM_HALF_FLOPS)`` of peak, the wave and launch overheads a small GEMM cannot hide."""
FIT = ("2026-12-03, tests/data/throughput/bridge_performance_summary.csv, 107 usable rows: RMS log error 0.220, "
       "median |error| 15.5%, worst 58.2% (Qwen3-30B-A3B on 16 H100)")
"""When and on what the constants were fitted, and their error."""


def gemm_efficiency(flops: float, fp8: bool = False) -> float:
    """The fraction of its precision's dense peak a GEMM of ``flops`` per-GPU FLOPs reaches: saturating in its size,
    half its large-size fraction at :data:`GEMM_HALF_FLOPS`."""
    fraction = GEMM_PEAK_FRACTION_FP8 if fp8 else GEMM_PEAK_FRACTION_BF16
    return fraction * flops / (flops + GEMM_HALF_FLOPS)
