"""Fine-grained activation offloading as a dimension of the search's candidates."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from megatron_bridge_ext.levers.activation_offload.cost import ATTENTION
from megatron_bridge_ext.search import candidates as cands

pytestmark = [pytest.mark.unit]


def _candidate(offload=()):
    return cands.Candidate(tp=2, pp=2, vpp=None, cp=1, ep=1, etp=1, dp=1, sp=True, micro_batch=2, recompute=(),
                           distributed_optimizer=True, offload=offload)


def _cfg():
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=256, micro_batch=1, vocab=128, tp=1,
                         sequence_parallel=False, dtype="bfloat16", swiglu=True)
    return tiny_config(shape, None)


@pytest.mark.parametrize("offload", [(), ATTENTION])
def test_the_overrides_set_the_offload_that_apply_sets(offload):
    from megatron_bridge_ext.estimate.configs import _with_overrides

    cfg = _cfg()
    cfg.model.fine_grained_activation_offloading, cfg.model.offload_modules = True, ["core_attn"]
    c = _candidate(offload)
    applied = cands.apply(cfg, c)
    overridden = _with_overrides(copy.deepcopy(cfg), c.overrides(cfg.model.num_layers))
    assert overridden.model.fine_grained_activation_offloading is applied.model.fine_grained_activation_offloading \
        is bool(offload)
    if offload:
        assert list(overridden.model.offload_modules) == list(applied.model.offload_modules) == list(offload)
    assert cands.given(applied, 1).offload == offload


def test_offloading_is_tried_where_bridge_allows_it():
    cfg = _cfg()
    assert cands.offload_sets(cfg.model) == [()]  # the tiny config is the local spec
    cfg.model.transformer_impl = "transformer_engine"
    assert cands.offload_sets(cfg.model) == [(), ATTENTION]
    cfg.model.cpu_offloading = True
    assert cands.offload_sets(cfg.model) == [()]


def test_each_layout_is_tried_with_and_without_the_offload():
    shape = {"heads": 4, "query_groups": 2, "layers": 4, "seq": 256, "experts": None, "bias": False}
    _, plain = cands.enumerate_all(shape, world=4, global_batch=8, modules=["core_attn"])
    _, both = cands.enumerate_all(shape, world=4, global_batch=8, modules=["core_attn"], offloads=((), ATTENTION))
    assert len(both) == 2 * len(plain)
    assert {c.offload for c in both} == {(), ATTENTION}


def test_offloading_holds_no_more_memory_than_not():
    assert _candidate(ATTENTION).below(_candidate())
    assert not _candidate().below(_candidate(ATTENTION))


def test_the_front_names_the_offload_a_candidate_turns_on():
    from megatron_bridge_ext.search.report import changes

    assert changes(_candidate(), _candidate(ATTENTION)) == "offload none->qkv_linear+core_attn+attn_proj"


def _optimizer_offloaded(share):
    return cands.Candidate(tp=2, pp=2, vpp=None, cp=1, ep=1, etp=1, dp=2, sp=True, micro_batch=2, recompute=(),
                           distributed_optimizer=True, optimizer_offload=share, optimizer_overlap=share is not None)


def test_offloading_more_of_the_optimizer_holds_no_more_memory():
    assert _optimizer_offloaded(1.0).below(_optimizer_offloaded(0.5))
    assert _optimizer_offloaded(0.5).below(_optimizer_offloaded(None))
    assert not _optimizer_offloaded(None).below(_optimizer_offloaded(0.5))
    assert not _optimizer_offloaded(0.5).below(_optimizer_offloaded(1.0))


def test_the_optimizer_is_offloaded_only_on_the_plain_distributed_optimizer_and_where_allowed():
    """Each legal layout with the distributed optimizer, no FSDP and fp32 moments is tried at both searched fractions;
    no other candidate is, and none at all where the config's optimizer may not be offloaded."""
    from megatron_bridge_ext.levers.optimizer_offload import SEARCHED

    shape = {"heads": 4, "query_groups": 2, "layers": 4, "seq": 256, "experts": None, "bias": False}
    _, plain = cands.enumerate_all(shape, world=4, global_batch=8, modules=["core_attn"])
    _, offloaded = cands.enumerate_all(shape, world=4, global_batch=8, modules=["core_attn"],
                                       optimizer_offload_allowed=True)
    hosts = [c for c in offloaded if c.optimizer_offload is not None]
    eligible = [c for c in plain if c.distributed_optimizer and c.fsdp is None and not c.bf16_moments]
    assert len(hosts) == len(SEARCHED) * len(eligible) and len(offloaded) == len(plain) + len(hosts)
    assert all(c.distributed_optimizer and c.fsdp is None and not c.bf16_moments and c.optimizer_overlap for c in hosts)
    assert {c.optimizer_offload for c in plain} == {None}


def test_the_front_names_the_optimizer_offload_a_candidate_turns_on():
    from megatron_bridge_ext.search.report import changes

    assert changes(_optimizer_offloaded(None), _optimizer_offloaded(0.5)) == \
        "optimizer offload off->0.5, offload overlap off->on"


def test_fp8_set_by_bridges_mixed_precision_leaves_megatron_fsdp_out_of_the_candidates():
    """A recipe's model carries no ``fp8`` until Bridge applies ``mixed_precision``; the given config's estimate
    settings do. The estimate does not model FP8 under Megatron-FSDP, so no FSDP candidate is enumerated for it."""
    from types import SimpleNamespace

    model = _cfg().model
    assert model.fp8 is None
    shape = cands.shape_of(model, SimpleNamespace(fp8="hybrid"))
    assert shape["fp8"] and not cands.shape_of(model, SimpleNamespace(fp8=None))["fp8"]
    _, legal = cands.enumerate_all(shape, world=4, global_batch=8, modules=["core_attn"])
    _, bf16 = cands.enumerate_all(cands.shape_of(model), world=4, global_batch=8, modules=["core_attn"])
    assert {c.fsdp for c in legal} == {None} and {c.fsdp for c in bf16} > {None}


def test_a_candidates_least_memory_relatives_hold_no_more_and_are_the_widest_it_covers():
    """The walk's probes: the widest recompute sets of the space covering the candidate's (with and without ``moe``,
    which Core refuses beside ``moe_act``) and the widest offload covering its own, at micro-batch 1 and its own;
    full recompute only for full; each below the candidate."""
    from megatron_bridge_ext.levers.recompute.advice import INSIDE_MOE

    rcs = tuple(cands.recompute_sets(["core_attn", "layernorm", "moe", *INSIDE_MOE[:1]]))
    offloads = ((), ATTENTION)
    c = cands.Candidate(tp=2, pp=1, vpp=None, cp=1, ep=2, etp=1, dp=2, sp=True, micro_batch=4,
                        recompute=("core_attn",), distributed_optimizer=True)
    relatives = cands.least_memory_relatives(c, rcs, offloads)
    widest = {("core_attn", "layernorm", "moe"), ("core_attn", "layernorm", INSIDE_MOE[0])}
    assert {frozenset(r.recompute) for r in relatives} == {frozenset(w) for w in widest}
    assert {r.micro_batch for r in relatives} == {1, 4} and len(relatives) == 4
    assert all(r.offload == ATTENTION and r.below(c) for r in relatives)
    full = cands.least_memory_relatives(replace(c, recompute=cands.FULL), rcs, offloads)
    assert [(r.recompute, r.micro_batch) for r in full] == [(cands.FULL, 1), (cands.FULL, 4)]


def _moe_te_model(**fields):
    from types import SimpleNamespace

    return SimpleNamespace(**{"transformer_impl": "transformer_engine", "cpu_offloading": False, "num_moe_experts": 8,
                              "moe_grouped_gemm": True, "use_transformer_engine_op_fuser": False,
                              "moe_paged_stash": False, **fields})


def test_the_experts_groups_are_tried_where_the_experts_open_them():
    """Grouped-GEMM experts without TE's op fuser open expert_fc1 and moe_act; not under FP8 (not modelled), the op
    fuser (fused_group_mlp only) or the paged stash (Core refuses them together)."""
    experts = ("expert_fc1", "moe_act")
    assert cands.offload_sets(_moe_te_model()) == [(), ATTENTION, experts, ATTENTION + experts]
    for model, fp8 in [(_moe_te_model(), True), (_moe_te_model(use_transformer_engine_op_fuser=True), False),
                       (_moe_te_model(moe_paged_stash=True), False), (_moe_te_model(moe_grouped_gemm=False), False)]:
        assert cands.offload_sets(model, fp8=fp8) == [(), ATTENTION]


def test_moe_recompute_is_never_paired_with_the_experts_groups_and_the_relatives_say_so():
    """Core refuses 'moe' recompute beside the experts' groups: no branch member pairs them, the branch's size counts
    what it holds, and a candidate's least-memory relative with 'moe' takes the widest offload Core allows with it."""
    experts = ("expert_fc1", "moe_act")
    shape = {"heads": 4, "query_groups": 2, "layers": 4, "seq": 256, "experts": 4, "bias": False}
    offloads = tuple(cands.offload_sets(_moe_te_model()))
    _, branches = cands.enumerate_branches(shape, world=4, global_batch=8, modules=["core_attn", "moe", "moe_act"],
                                           offloads=offloads)
    members = [c for b in branches for c in b.members()]
    assert sum(b.size() for b in branches) == len(members)
    assert not any("moe" in c.recompute and set(c.offload) & set(experts) for c in members if c.recompute != cands.FULL)
    assert any(c.recompute == ("moe",) for c in members) and any(c.offload == experts for c in members)
    c = next(c for c in members if c.recompute == () and c.offload == () and c.micro_batch > 1)
    relatives = cands.least_memory_relatives(c, branches[0].recomputes, offloads)
    by_rc = {frozenset(r.recompute): r.offload for r in relatives}
    assert by_rc == {frozenset({"core_attn", "moe"}): ATTENTION,
                     frozenset({"core_attn", "moe_act"}): ATTENTION + experts}
    assert all(r.below(c) and cands.compatible(r.recompute, r.offload) for r in relatives)
