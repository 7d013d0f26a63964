"""Multi-latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight, GLM-5): Megatron Core's ``MLASelfAttention``."""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding


def used(model) -> bool:
    return bool(getattr(model, "multi_latent_attention", False))


def findings(model) -> list[Finding]:
    if not used(model):
        return []
    return [Finding("unsupported_model", ERROR, "model.multi_latent_attention",
                    "multi-latent attention is not modelled by the estimate",
                    "estimate a GPT config without it, or use Bridge's estimate_training_memory")]
