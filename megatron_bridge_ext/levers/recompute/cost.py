"""What recompute costs in the plan: the forward FLOPs it repeats per step."""

from __future__ import annotations

BASIS = "formula: forward GEMM FLOPs of the recomputed modules x layers x microbatches"


def recompute_flops_per_layer(module: str, s: dict) -> int:
    """Forward FLOPs one layer repeats per microbatch when ``module`` is recomputed (GEMMs, 2 per MAC)."""
    seq, b, h, tp = s["seq_length"], s["micro_batch"], s["hidden"], s["tp"]
    if module == "core_attn":
        heads, d = s["heads"] // tp, s["kv_channels"]
        return 4 * b * seq * seq * heads * d  # QK^T and attention x V, full s x s (causal kernels skip about half)
    if module == "mlp":
        ffn = s["ffn"] // tp
        return 2 * b * seq * h * ffn * ((2 if s["gated_linear_unit"] else 1) + 1)
    return 0  # layernorm: no GEMM


def recompute_flops(s: dict, modules: list[str]) -> int:
    """Forward FLOPs recomputing ``modules`` repeats per step on this rank's layers (``s``: estimate settings)."""
    return sum(recompute_flops_per_layer(m, s) for m in modules) * s["layers_on_stage"] * s["num_microbatches"]
