"""Latent MoE (``moe_latent_size``, Nemotron 3 Super and Ultra): the experts work in a smaller latent space."""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding


def findings(model) -> list[Finding]:
    if not getattr(model, "num_moe_experts", None) or not getattr(model, "moe_latent_size", None):
        return []
    return [Finding("unsupported_model", ERROR, "model.moe_latent_size",
                    "latent MoE projections are not modelled by the estimate", "estimate without them")]
