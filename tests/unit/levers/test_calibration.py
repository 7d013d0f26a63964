"""The step time's calibration: the efficiency curve's shape from its constants, the published rows it is fitted on,
and the published ranking of three Llama 3 70B layouts."""

from __future__ import annotations

import csv
import statistics

import pytest

from megatron_bridge_ext.levers import calibration, published, steptime

pytestmark = [pytest.mark.unit]

HALF = calibration.GEMM_HALF_FLOPS


@pytest.mark.parametrize("fp8", [False, True])
def test_gemm_efficiency_is_below_its_fraction_half_of_it_at_the_half_size_and_rises_with_size(fp8):
    fraction = calibration.GEMM_PEAK_FRACTION_FP8 if fp8 else calibration.GEMM_PEAK_FRACTION_BF16
    sizes = [HALF / 100, HALF / 10, HALF, 10 * HALF, 1000 * HALF]
    effs = [calibration.gemm_efficiency(f, fp8) for f in sizes]
    assert all(e < fraction < 1 for e in effs)
    assert effs == sorted(effs) and len(set(effs)) == len(effs)
    assert calibration.gemm_efficiency(HALF, fp8) == pytest.approx(fraction / 2, rel=1e-12)
    assert effs[0] == pytest.approx(fraction / 101, rel=1e-12) and effs[-1] == pytest.approx(fraction * 1000 / 1001)


def test_the_fit_names_its_data_file_and_the_data_is_there():
    assert "bridge_performance_summary.csv" in calibration.FIT and "median" in calibration.FIT
    assert published.SUMMARY.endswith("bridge_performance_summary.csv")


def test_bridges_flops_per_token_matches_the_published_tflops_over_tokens():
    """The published TFLOP/s/GPU over tokens/s/GPU is the FLOPs per token Bridge counted: the model's count agrees to
    0.5% at the median of the usable pre-training rows and within 3% on each (the published figures are rounded,
    and a few rows disagree with their own release's)."""
    with open(published.SUMMARY) as f:
        rows = [r for r in csv.DictReader(f) if published.skip_reason(r) is None]
    assert len(rows) > 50
    ratios = []
    for r in rows:
        c = published.config(published.CONFIGS[r["model"]])
        measured = float(r["tflops_per_gpu"]) * 1e12 / float(r["tokens_per_s_per_gpu"])
        ratios.append(published.flops_per_token(c, int(r["seq"]), int(r["tp"])) / measured)
    assert statistics.median(ratios) == pytest.approx(1, abs=0.005)
    assert all(abs(x - 1) < 0.03 for x in ratios)


def test_rows_the_step_time_cannot_price_are_skipped_with_a_reason():
    usable, skipped = published.rows()
    reasons = {r["model"]: why for r, why in skipped}
    assert "Mamba" in reasons["Nemotron_3_Super"] and "sliding-window" in reasons["GPT OSS 120B"]
    assert all("SUPERSEDED" not in r.label for r in usable)
    assert {r.gpu for r in usable} == {"h100", "b200", "b300", "gb200", "gb300"}


SFT_LAYOUTS = [dict(tp=4, pp=4, vpp=5, dp=2), dict(tp=4, pp=8, vpp=5, dp=1), dict(tp=8, pp=4, vpp=5, dp=1)]
"""Llama 3 70B SFT on 32 H100 in FP8, seq 4096, global batch 32: published 704, 668.0 and 508.7 TFLOP/s/GPU
(Megatron Bridge, Memory Tuning), in that order."""


def test_the_published_llama3_70b_layouts_rank_as_measured():
    c = published.config("llama-3-70b")
    times = [steptime.step_time(published.settings(c, cp=1, seq=4096, mbs=1, gbs=32, fp8=True, **layout),
                                steptime.gpu("h100")).total for layout in SFT_LAYOUTS]
    assert times == sorted(times)
