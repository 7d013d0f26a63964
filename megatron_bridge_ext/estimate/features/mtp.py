"""Multi-token prediction (DeepSeek-V3, GLM-4.5, Qwen3-Next, Nemotron 3 Super): Megatron Core's MTP block."""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding


def used(model) -> bool:
    return bool(getattr(model, "mtp_num_layers", None))


def findings(model) -> list[Finding]:
    if not used(model):
        return []
    return [Finding("unsupported_model", ERROR, "model.mtp_num_layers",
                    "multi-token prediction is not modelled by the estimate",
                    "estimate a GPT config without it, or use Bridge's estimate_training_memory")]
