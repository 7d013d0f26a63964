"""Megatron Core's refusals of the MoE recompute modules (``RecomputeConfig.findings``), each against the
``TransformerConfig`` it mirrors: the model Core refuses is refused here, the model Core builds is not."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.findings import ERROR, NO_EFFECT
from megatron_bridge_ext.levers.recompute.config import RecomputeConfig

pytestmark = [pytest.mark.unit]

MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
           moe_ffn_hidden_size=32)

CASES = [
    # (modules, extra model fields, code of the finding or None, Core refuses the model)
    (["shared_experts"], dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True,
                              moe_token_dispatcher_type="alltoall"), "shared_experts_overlap", True),
    (["shared_experts"], dict(moe_shared_expert_intermediate_size=64), None, False),
    (["shared_experts"], {}, "recompute_no_shared_experts", False),  # Core accepts it, and it recomputes nothing
    (["moe_act"], dict(moe_grouped_gemm=True), None, False),
    (["moe_act"], {}, "moe_act_grouped_gemm", True),
    (["moe"], {}, None, False),
]


@pytest.mark.parametrize("modules, fields, code, core_refuses", CASES, ids=[f"{m}-{c}" for m, _, c, _ in CASES])
def test_moe_module_findings_follow_core(modules, fields, code, core_refuses):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {**MOE, **fields, "recompute_granularity": "selective", "recompute_modules": list(modules)}
    try:
        model = TransformerConfig(**fields)
        refused = False
    except ValueError:
        refused = True
        model = TransformerConfig(**{**fields, "recompute_granularity": None})
    assert refused is core_refuses
    findings = RecomputeConfig(recompute_modules=modules).findings(model)
    assert [f.code for f in findings] == ([code] if code else [])
    if code:
        assert findings[0].level == (ERROR if core_refuses else NO_EFFECT)


@pytest.mark.parametrize("field", ["overlap_moe_expert_parallel_comm", "fine_grained_activation_offloading"])
def test_moe_recompute_refused_with_what_core_refuses_it_with(field):
    from types import SimpleNamespace

    model = SimpleNamespace(num_moe_experts=4, overlap_moe_expert_parallel_comm=field == "overlap_moe_expert_parallel_comm",
                            fine_grained_activation_offloading=field == "fine_grained_activation_offloading",
                            offload_modules=["expert_fc1", "core_attn"])
    codes = [f.code for f in RecomputeConfig(recompute_modules=["moe"]).findings(model)]
    assert codes == {"overlap_moe_expert_parallel_comm": ["moe_recompute_ep_overlap"],
                     "fine_grained_activation_offloading": ["moe_recompute_offload"]}[field]
    assert RecomputeConfig(recompute_modules=["core_attn"]).findings(model) == []
