"""The MoE token dispatchers: Core's ``allgather`` and ``alltoall`` are traced; ``flex`` runs DeepEP or HybridEP."""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding

TRACED = ("allgather", "alltoall")
"""The token dispatchers the estimate traces on Core's own code."""


def findings(model) -> list[Finding]:
    if not getattr(model, "num_moe_experts", None):
        return []
    dispatcher = getattr(model, "moe_token_dispatcher_type", "allgather")
    if dispatcher in TRACED:
        return []
    return [Finding("unsupported_model", ERROR, "model.moe_token_dispatcher_type",
                    f"the {dispatcher!r} token dispatcher is not modelled by the estimate"
                    + (" (its DeepEP / HybridEP kernels do not run here)" if dispatcher == "flex" else ""),
                    "estimate the same experts with Core's all-to-all dispatcher: add the override "
                    "model.moe_token_dispatcher_type=alltoall")]
