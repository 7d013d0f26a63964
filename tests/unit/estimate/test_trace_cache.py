"""Inside trace_cache.reuse() an estimate that differs only in DP or the pipeline split reuses a stage's trace, and
its figures are those of the estimate traced afresh."""

from __future__ import annotations

import copy

import pytest

from megatron_bridge_ext.estimate import memory, trace_cache

pytestmark = [pytest.mark.unit]


def _cfg():
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=12, hidden=64, ffn=256, heads=4, kv_heads=2, seq=128, micro_batch=1, vocab=128, tp=2,
                         dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, None)
    cfg.data_parallel_size, cfg.train.global_batch_size = 2, 8
    return cfg


def _variants():
    out = []
    for pp, dp in ((2, 2), (2, 4), (3, 2)):
        cfg = copy.deepcopy(_cfg())
        cfg.model.pipeline_model_parallel_size = pp
        out.append((cfg, dp))
    return out


def _figures(est):
    return est.stage_peaks, [(c.name, c.bytes) for c in est.components]


def test_reused_traces_give_the_figures_of_fresh_ones():
    fresh = [_figures(memory.estimate(cfg, data_parallel_size=dp)) for cfg, dp in _variants()]
    with trace_cache.reuse():
        reused = [_figures(memory.estimate(cfg, data_parallel_size=dp)) for cfg, dp in _variants()]
        hits = trace_cache.hits
    assert reused == fresh
    assert hits >= 4  # DP 4 reuses both stages of DP 2; PP 3 its first and last stage (each traced with 2 layers)


def test_nothing_is_kept_outside_reuse():
    cfg, dp = _variants()[0]
    assert trace_cache.key(cfg.model, None, 0, None) is None


def test_a_reuse_inside_another_goes_on_with_the_outer_traces():
    """The plan reuses traces over all its estimates, the search inside it among them: the inner reuse neither
    drops the outer's traces nor keeps its own apart."""
    with trace_cache.reuse():
        trace_cache.get_or_trace("stage", lambda: ("outer",))
        with trace_cache.reuse():
            assert trace_cache.get_or_trace("stage", lambda: ("inner",)) == ("outer",)
            trace_cache.get_or_trace("other stage", lambda: ("inner",))
        assert trace_cache.get_or_trace("other stage", lambda: ("after",)) == ("inner",)
