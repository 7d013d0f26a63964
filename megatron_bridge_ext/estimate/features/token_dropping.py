"""Token dropping (expert capacity): the estimate's routing stand-in is dropless."""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding


def findings(model) -> list[Finding]:
    if not getattr(model, "num_moe_experts", None):
        return []
    if getattr(model, "moe_expert_capacity_factor", None) is None and \
            not getattr(model, "moe_pad_expert_input_to_capacity", False):
        return []
    return [Finding("unsupported_model", ERROR, "model.moe_expert_capacity_factor",
                    "token dropping (expert capacity) is not modelled by the estimate",
                    "estimate the dropless config (moe_expert_capacity_factor=None), an upper bound")]
