"""FP8 on the experts' grouped linears: their quantised weights and the quantised inputs Transformer Engine keeps."""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding


def findings(model) -> list[Finding]:
    if not (getattr(model, "fp8", None) and getattr(model, "num_moe_experts", None)):
        return []
    return [Finding("unsupported_model", ERROR, "model.fp8",
                    "FP8 on mixture-of-experts layers is not modelled by the estimate (the expert linears' quantised "
                    "copies are not counted)", "estimate the bf16 config")]
