"""The MoE token dispatchers: Core's ``allgather`` and ``alltoall`` are traced, and ``flex`` on DeepEP and on HybridEP
with stand-ins for their kernels (:mod:`.flex`, :mod:`.hybridep`); ``flex`` on NCCL EP is refused."""

from __future__ import annotations

from megatron_bridge_ext.estimate.features import flex, hybridep
from megatron_bridge_ext.findings import ERROR, Finding

TRACED = ("allgather", "alltoall")
"""The token dispatchers the estimate traces on Core's own code."""


def findings(model) -> list[Finding]:
    if not getattr(model, "num_moe_experts", None):
        return []
    dispatcher = getattr(model, "moe_token_dispatcher_type", "allgather")
    if dispatcher in TRACED:
        return []
    if dispatcher != "flex":
        return [_refused("model.moe_token_dispatcher_type",
                         f"the {dispatcher!r} token dispatcher is not modelled by the estimate")]
    backend = getattr(model, "moe_flex_dispatcher_backend", None)
    if backend == hybridep.HYBRIDEP:
        return hybridep.findings(model)
    if backend != flex.DEEPEP:
        return [Finding("unsupported_model", ERROR, "model.moe_flex_dispatcher_backend",
                        f"the flex dispatcher's {backend!r} backend is not modelled by the estimate (what its "
                        "kernels keep for backward and its buffers are not sized; DeepEP's and HybridEP's are)",
                        "estimate the same experts on DeepEP: add the override "
                        "model.moe_flex_dispatcher_backend=deepep")]
    return flex.findings(model)


def _refused(setting: str, message: str) -> Finding:
    return Finding("unsupported_model", ERROR, setting, message,
                   "estimate the same experts with Core's all-to-all dispatcher: add the override "
                   "model.moe_token_dispatcher_type=alltoall")
