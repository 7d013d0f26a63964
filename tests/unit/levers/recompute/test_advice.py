"""Step 3 of the plan on a mixture-of-experts config (``megatron_bridge_ext/levers/recompute/advice.py``): the MoE
modules join the candidates, Core's refusals are checked before anything is estimated, the modules are added
cheapest (recomputed FLOPs per byte saved) first, and what ``moe`` already covers is not added again.

The estimate is a stand-in whose peak drops by a set saving per module, so that the order is the test's choice."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate.report import STATIC, Component, MemoryEstimate
from megatron_bridge_ext.levers.recompute import advice
from megatron_bridge_ext.levers.step import State
from megatron_bridge_ext.planner import Planner
from tests.support.settings import gpt_stage, latent

pytestmark = [pytest.mark.unit]

MIB = 2**20
PEAK = 4096 * MIB
SEQ, MB, H, TP, EXPERTS, TOPK, MOE_FFN, SHARED = 256, 2, 64, 2, 4, 2, 64, 128


def _cfg(*, grouped_gemm=False, shared=SHARED):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=2, hidden=H, ffn=256, heads=8, kv_heads=4, seq=SEQ, micro_batch=MB, vocab=128, tp=TP,
                         dtype="bfloat16", swiglu=True, experts=EXPERTS, topk=TOPK, moe_ffn=MOE_FFN,
                         dispatcher="alltoall", ep=2, etp=1)
    extra = {"moe_shared_expert_intermediate_size": shared} if shared else {}
    cfg = tiny_config(shape, None, moe_grouped_gemm=grouped_gemm, **extra)
    cfg.data_parallel_size = 2
    return cfg


def _estimate(cfg, peak: int) -> MemoryEstimate:
    m = cfg.model
    settings = gpt_stage(tp=TP, pp=1, cp=1, dp=2, sequence_parallel=True, seq_length=SEQ, micro_batch=MB,
                         num_microbatches=1, dtype="bfloat16", stage=0, layers_on_stage=2, num_layers=2, hidden=H,
                         ffn=256, heads=8, kv_channels=8, gated_linear_unit=True, peft=None,
                         recompute_granularity=m.recompute_granularity,
                         recompute_modules=tuple(m.recompute_modules or []), attention="local",
                         transformer_impl="local")
    return MemoryEstimate(stage=0, components=[Component(STATIC, "weights", peak, "stand-in")], settings=settings,
                          assumptions=[], activations_per_microbatch={}, in_flight_microbatches=1.0)


class _Planner(Planner):
    def __init__(self, cfg, savings):
        super().__init__(gpu_memory=1, margin=0.0, expandable_margin=0.0, expandable_segments=True,
                         estimate_options={}, cfg=cfg, peft_overrides=None)
        self.savings, self.estimated = savings, []

    def estimate(self, cfg, **overrides):
        modules = list(cfg.model.recompute_modules or [])
        self.estimated.append(modules)
        return _estimate(cfg, PEAK - sum(self.savings.get(m, 0) for m in modules))


def _step3(cfg, savings):
    planner = _Planner(cfg, savings)
    advice.options(planner, State(cfg, _estimate(cfg, PEAK)))
    return planner


def test_moe_act_without_grouped_gemm_is_refused_before_it_is_estimated():
    planner = _step3(_cfg(grouped_gemm=False), {"moe": 8 * MIB})
    refused = next(o for o in planner.options if o.label == "recompute moe_act")
    assert not refused.applicable and [c.code for c in refused.constraints] == ["moe_act_grouped_gemm"]
    assert not any("moe_act" in modules for modules in planner.estimated)  # Core would refuse the model


def test_shared_experts_is_a_candidate_only_with_shared_experts():
    with_shared = {tuple(m) for m in _step3(_cfg(grouped_gemm=True), {}).estimated}
    without = {tuple(m) for m in _step3(_cfg(grouped_gemm=True, shared=0), {}).estimated}
    assert ("shared_experts",) in with_shared and ("shared_experts",) not in without
    assert ("moe",) in without


def test_moe_act_with_grouped_gemm_is_measured_like_any_module():
    """The estimate measures what TEGroupedMLP's moe_act recompute saves (estimate.features.moe_act): the option is
    estimated and offered with its saving."""
    planner = _step3(_cfg(grouped_gemm=True), {"moe_act": 8 * MIB})
    assert ["moe_act"] in planner.estimated
    option = next(o for o in planner.options if "moe_act" in o.label)
    assert option.applicable


def _flops_moe_layer() -> int:
    """Router, routed experts and shared experts of one MoE layer on a rank, 2 FLOPs per multiply-add."""
    tokens = SEQ // TP * MB  # the rank's sequence shard
    router = 2 * tokens * H * EXPERTS
    routed = 2 * (tokens * TOPK) * H * (2 * MOE_FFN) + 2 * (tokens * TOPK) * MOE_FFN * H  # SwiGLU fc1, fc2
    return router + routed + _flops_shared()


def _flops_shared() -> int:
    tokens = SEQ * MB  # gathered under SP
    return 2 * tokens * H * (2 * SHARED // TP) + 2 * tokens * (SHARED // TP) * H


def test_cheapest_per_byte_first_and_moe_priced_with_its_repeated_dispatch():
    # shared_experts: about half moe's FLOPs for 50 MiB, moe twice as many for 60 MiB: shared_experts first
    assert _flops_shared() / 50 < _flops_moe_layer() / 60
    planner = _step3(_cfg(grouped_gemm=True), {"layernorm": 1 * MIB, "shared_experts": 50 * MIB, "moe": 60 * MIB})
    applied = [o for o in planner.options if o.applicable]
    assert [o.label for o in applied] == [
        "recompute_modules=['layernorm']", "recompute_modules=['layernorm', 'shared_experts']",
        "recompute_modules=['layernorm', 'shared_experts', 'moe']"]
    moe = applied[-1].cost  # an option's cost is that of every module it recomputes
    assert moe.recomputed_flops == 2 * (_flops_moe_layer() + _flops_shared())  # two MoE layers, one microbatch
    tokens = SEQ // TP * MB
    assert moe.collective_bytes == 2 * (2 * tokens * TOPK * H * 2 // 2)  # dispatch + combine forward, half leave
    assert applied[0].cost.recomputed_flops == 0 and applied[0].cost.collective_bytes is None
    nothing = {o.label for o in planner.options if o.reason == "saves nothing here (measured)"}
    assert nothing == {"recompute core_attn", "recompute moe_act"}  # no saving set for them
    assert ["mlp"] not in planner.estimated  # no dense layer on the stage: mlp recompute has nothing to recompute


def test_what_moe_already_recomputes_is_not_added_after_it():
    planner = _step3(_cfg(grouped_gemm=True), {"moe": 4000 * MIB, "shared_experts": 50 * MIB})
    labels = [(o.label, o.applicable) for o in planner.options if o.label.startswith("recompute_modules")]
    assert labels == [("recompute_modules=['moe']", True), ("recompute_modules=['moe', 'shared_experts']", False)]
    skipped = [o for o in planner.options if o.label == labels[1][0]][0]
    assert skipped.reason == "'moe' recompute already recomputes shared_experts (the whole MoE layer)"


def test_mla_up_proj_is_a_candidate_only_with_multi_latent_attention():
    s = gpt_stage(transformer_impl="transformer_engine")
    assert "mla_up_proj" not in advice.candidates_for(s, None)
    assert "mla_up_proj" in advice.candidates_for(gpt_stage(transformer_impl="transformer_engine", mla=latent()), None)
