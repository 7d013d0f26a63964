"""The search's pruning loses nothing: on a small model, estimating every legal candidate finds the same fastest
fitting one as the walk, and the walk's front holds only estimated candidates, its fitting ones dominated by no legal
candidate."""

from __future__ import annotations

import math

import pytest

from megatron_bridge_ext.levers import steptime
from megatron_bridge_ext.levers.parallelism.cost import moe_shape
from megatron_bridge_ext.search import candidates as cands
from megatron_bridge_ext.search import walk

pytestmark = [pytest.mark.e2e]


def _cfg():
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=256, micro_batch=1, vocab=128, tp=1,
                         sequence_parallel=False, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, None)
    cfg.data_parallel_size, cfg.train.global_batch_size = 4, 8
    return cfg


def _without_memory_levers(c) -> bool:
    """No Megatron-FSDP, bf16 moments, activation offloading or optimizer offload: each of those multiplies the legal
    set, so the test keeps them on one layout (TP 1 PP 1 CP 1, DP 4) and every layout without them."""
    return c.fsdp is None and not c.bf16_moments and not c.offload and c.optimizer_offload is None


def test_the_walk_finds_the_fastest_fitting_candidate_of_all():
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.levers.recompute.advice import candidates_for

    cfg = _cfg()
    base = estimate(cfg)
    gpu = steptime.gpu()
    # usable memory between the smallest and the largest peak, so that some candidates fit and some do not
    shape = cands.shape_of(cfg.model)
    _, every = cands.enumerate_all(shape, world=4, global_batch=8, modules=candidates_for(base.settings, None))
    legal = [c for c in every if _without_memory_levers(c) or (c.tp, c.pp, c.cp) == (1, 1, 1)]
    assert len(legal) < len(every) and not all(_without_memory_levers(c) for c in legal)
    everything = walk.search(cfg, base, world=4, usable=1, usable_expandable=1, expandable_on=True, gpu=gpu,
                             estimate_options={}, budget_s=math.inf, legal=legal)
    peaks = {}
    for c in legal:
        est = estimate(cands.apply(cfg, c), data_parallel_size=c.dp, num_microbatches=8 // (c.micro_batch * c.dp))
        peaks[c] = (est.peak_bytes, steptime.step_time(est.settings, gpu, moe=moe_shape(cfg.model)).total)
    usable = sorted(p for p, _ in peaks.values())[len(peaks) // 2]
    result = walk.search(cfg, base, world=4, usable=usable, usable_expandable=usable, expandable_on=True, gpu=gpu,
                         estimate_options={}, budget_s=math.inf, legal=legal)
    fastest = min(t for p, t in peaks.values() if p <= usable)
    assert result.answer is not None and result.answer.peak_bytes <= usable
    assert result.answer.step_time_s == pytest.approx(fastest)
    assert result.counts["estimated"] < len(legal)  # something was pruned
    assert not everything.answer  # nothing fits in one byte
    estimated = {e.candidate for e in result.evaluated}
    for e in result.front:
        assert e.candidate in peaks
        # a fitting point of the front is beaten by no legal candidate; one that does not fit, by none the walk
        # estimated (it prunes what cannot fit without estimating it, so beyond the usable memory the front is the
        # front of what it estimated)
        rivals = peaks if e.fits else {c: peaks[c] for c in estimated}
        assert not any(p < e.peak_bytes and t < e.step_time_s for p, t in rivals.values()), e.candidate
