"""Context parallelism: a rank's activations at s / CP, and the attention's exchange buffers by ``cp_comm_type``."""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding


def used(model) -> bool:
    return (getattr(model, "context_parallel_size", 1) or 1) > 1


def findings(model) -> list[Finding]:
    if not used(model):
        return []
    return [Finding("unsupported_model", ERROR, "model.context_parallel_size",
                    "context parallelism is not modelled by the estimate", "estimate with context_parallel_size=1")]
