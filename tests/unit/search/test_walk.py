"""The walk's pruning of optimizer CPU offload: offloaded only where the same candidate without it does not fit."""

from __future__ import annotations

import types

import pytest

from megatron_bridge_ext.search import candidates as cands
from megatron_bridge_ext.search.walk import _offload_unneeded

pytestmark = [pytest.mark.unit]


def _c(share=None):
    return cands.Candidate(tp=2, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=4, sp=True, micro_batch=1, recompute=(),
                           distributed_optimizer=True, optimizer_offload=share, optimizer_overlap=share is not None)


@pytest.mark.parametrize("twin_fits, expected", [(True, True), (False, False)])
def test_an_offloaded_candidate_is_skipped_when_its_twin_fits(twin_fits, expected):
    done = {_c(): types.SimpleNamespace(fits=twin_fits)}
    assert _offload_unneeded(_c(0.5), done, set(), given=None) is expected


def test_an_offloaded_candidate_is_skipped_when_its_twin_was_dominated_and_kept_when_it_was_refused():
    assert _offload_unneeded(_c(1.0), {}, {_c()}, given=None)
    assert not _offload_unneeded(_c(1.0), {_c(): None}, set(), given=None)


def test_neither_a_candidate_without_the_offload_nor_the_config_as_given_is_skipped():
    fitting = {_c(): types.SimpleNamespace(fits=True)}
    assert not _offload_unneeded(_c(), fitting, set(), given=None)
    assert not _offload_unneeded(_c(0.5), fitting, set(), given=_c(0.5))


@pytest.fixture(scope="module")
def space():
    """A tiny dense model's estimate and every legal candidate on 8 GPUs with every lever the search has."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.levers.activation_offload.cost import ATTENTION
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=8, hidden=256, ffn=1024, heads=8, kv_heads=4, seq=1024, micro_batch=1, vocab=512,
                         tp=1, sequence_parallel=False, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, None)
    cfg.data_parallel_size, cfg.train.global_batch_size = 1, 16
    base = estimate(cfg).settings
    workload = cands.shape_of(cfg.model, base)
    _, branches = cands.enumerate_branches(workload, world=8, global_batch=16, modules=["core_attn", "mlp", "layernorm"],
                                           offloads=((), ATTENTION), optimizer_offload_allowed=True)
    return base, workload, branches


def _predict(base, workload, c):
    from megatron_bridge_ext.levers import steptime
    from megatron_bridge_ext.search.walk import _predicted_time

    return _predicted_time(base, c, workload, 16, steptime.gpu(), None)


def test_no_candidate_is_predicted_faster_than_the_bound_of_a_branch_it_is_in(space):
    """The lazy walk order rests on it: every candidate's predicted step time is at least its layout's bound and its
    layout-and-recompute branch's."""
    from megatron_bridge_ext.levers import steptime
    from megatron_bridge_ext.search.walk import branch_bound

    base, workload, branches = space
    checked = 0
    for branch in branches:
        top = branch_bound(base, branch, workload, 16, steptime.gpu(), None)
        for child in branch.children():
            below = branch_bound(base, child, workload, 16, steptime.gpu(), None)
            for c in child.members():
                t = _predict(base, workload, c)
                assert t >= top * (1 - 1e-12) and t >= below * (1 - 1e-12), c.describe()
                checked += 1
    assert checked == sum(b.size() for b in branches) > 1000


def test_the_lazy_order_is_the_walk_order_and_predicts_only_what_it_reaches(space):
    """Every legal candidate comes out once, fastest predicted first and fewer levers first at equal time, as
    ``rule.walk_order`` sorts them; taking the first few predicts a small part of the space."""
    import itertools

    from megatron_bridge_ext.levers import steptime
    from megatron_bridge_ext.search import rule
    from megatron_bridge_ext.search.walk import branch_bound, lazy_order

    base, workload, branches = space
    every = [c for b in branches for c in b.members()]
    given = every[0]

    def bound(branch):
        return branch_bound(base, branch, workload, 16, steptime.gpu(), None)

    predicted: dict = {}
    order = list(lazy_order(branches, lambda c: _predict(base, workload, c), bound, given, predicted))
    assert sorted(order, key=lambda c: c.describe()) == sorted(every, key=lambda c: c.describe())
    keys = [(predicted[c], rule.lever_count(given, c)) for c in order]
    assert keys == sorted(keys)
    expected = {c: _predict(base, workload, c) for c in every}
    assert [expected[c] for c in order] == [expected[c] for c in rule.walk_order(every, expected, given)]
    few: dict = {}
    list(itertools.islice(lazy_order(branches, lambda c: _predict(base, workload, c), bound, given, few), 10))
    assert len(few) < len(every) / 4


def test_a_floor_below_a_fitting_candidate_is_not_estimated():
    """A micro-batch-1 floor is estimated to prune its family when it does not fit; one that holds no more than a
    candidate that fits (more recompute, the same layout) fits too, prunes nothing, and is not estimated."""
    from megatron_bridge_ext.search import walk

    def c(mb, recompute):
        return cands.Candidate(tp=2, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=4, sp=True, micro_batch=mb,
                               recompute=recompute, distributed_optimizer=True)

    peak = {c(1, ()): 50, c(2, ()): 90, c(1, ("mlp",)): 40, c(2, ("mlp",)): 80}
    search = walk.Search(c(4, ()), world=8, global_batch=8, seq=1024, usable=60, usable_expandable=60)

    class Run:
        def __init__(self):
            self.done, self.unfit, self.calls = {}, [], []

        def __call__(self, x):
            self.calls.append(x)
            e = types.SimpleNamespace(candidate=x, peak_bytes=peak[x], fits=peak[x] <= 60, step_time_s=1.0)
            self.done[x] = e
            search.evaluated.append(e)
            if not e.fits:
                self.unfit.append(x)
            return e

    run = Run()
    order = [c(2, ()), c(2, ("mlp",))]
    walk._walk(run, search, order, {x: 1.0 for x in order}, budget_s=0.0)
    assert run.calls == [c(1, ()), c(2, ()), c(2, ("mlp",))]


def test_a_lora_search_runs_the_lora_a_input_shard_local_wherever_sp_is_on():
    """A LoRA config with the LoRA-A input off: the search sets ``shard_local`` on every candidate with SP (it keeps
    the adapters' input shard instead of the gathered input: less memory, no gather), off elsewhere, and the answer's
    MemoryConfig line says so."""
    import math

    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.levers import steptime
    from megatron_bridge_ext.levers.lora_input.config import shard_local_wanted
    from megatron_bridge_ext.peft import LoRA
    from megatron_bridge_ext.search import report, walk
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=2, hidden=64, ffn=256, heads=4, kv_heads=2, seq=256, micro_batch=1, vocab=128, tp=1,
                         sequence_parallel=False, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, LoRA(target_modules=list(shape.lora_targets), dim=8, alpha=8))
    cfg.data_parallel_size, cfg.train.global_batch_size = 1, 2
    assert shard_local_wanted(cfg)
    result = walk.search(cfg, estimate(cfg), world=2, usable=1 << 40, usable_expandable=1 << 40, expandable_on=True,
                         gpu=steptime.gpu(), estimate_options={}, budget_s=math.inf, keep_estimates=True,
                         shard_local=True)
    kept = result.estimator.estimates
    assert {c.sp for c in kept} == {True, False}
    for c, (c_cfg, _) in kept.items():
        assert c_cfg.peft.strategy_in_effect == ("shard_local" if c.sp else "off"), c.describe()
    sp = next(c for c in kept if c.sp)
    without = estimate(cands.apply(cfg, sp), data_parallel_size=sp.dp,
                       num_microbatches=2 // (sp.micro_batch * sp.dp))
    assert kept[sp][1].peak_bytes < without.peak_bytes
    row = report.row(result, next(e for e in result.evaluated if e.candidate == sp))
    assert "sequence_parallel_input_strategy='shard_local'" in row["memory_config"]
    assert row["changes"].endswith("LoRA-A input off->shard_local")
