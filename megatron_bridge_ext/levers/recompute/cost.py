"""What recompute costs in the plan: the forward FLOPs it repeats per step (and, for ``moe``, the token dispatch
it repeats)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_bridge_ext.levers.parallelism.cost import dispatch_bytes_per_layer, layer_counts, tokens_per_rank

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.settings import Settings

BASIS = "formula: forward GEMM FLOPs of the recomputed modules x layers x microbatches"
MOE_BASIS = ("formula: forward GEMM FLOPs of the recomputed modules x their layers (dense layers for mlp, MoE layers "
             "for moe, moe_act and shared_experts) x microbatches; moe repeats the router (T*h*E), the routed experts "
             "(T*k tokens through fc1 and fc2 of width moe_ffn) and the shared experts, T = s*b/t tokens on the rank; "
             "moe_act and layernorm repeat no GEMM; moe also repeats its forward dispatch and combine; mla_up_proj "
             "repeats multi-latent attention's up projections on the whole sequence")
MLP_MODULES = ("mlp",)
"""Modules recomputed on dense layers only (Core's TransformerLayer skips ``mlp`` recompute on an MoE layer)."""
MOE_LAYER_MODULES = ("moe", "moe_act", "shared_experts")
"""Modules recomputed on MoE layers only."""
ATTENTION_MODULES = ("core_attn", "mla_up_proj")
"""Modules recomputed in every attention layer."""


def _mlp_flops(tokens: int, h: int, ffn: int, gated: bool) -> int:
    """fc1 (h -> ffn, twice with a gated unit) and fc2 (ffn -> h) on ``tokens`` tokens, 2 FLOPs per multiply-add."""
    return 2 * tokens * h * ffn * ((2 if gated else 1) + 1)


def shared_expert_flops(s: Settings, moe: dict) -> int:
    """The shared experts' forward on one MoE layer and microbatch: a dense MLP of width ``shared_ffn`` sharded over
    TP, on the gathered sequence under SP (they follow attention's TP)."""
    if not moe["shared_ffn"]:
        return 0
    return _mlp_flops(s.seq_length * s.micro_batch, s.hidden, moe["shared_ffn"] // s.tp,
                      s.gated_linear_unit)


def moe_layer_flops(s: Settings, moe: dict) -> int:
    """One MoE layer's forward GEMMs per microbatch on a rank: the router on its T tokens (T x h x E), the routed
    experts (T*k token copies through fc1 and fc2 of width moe_ffn: under balanced routing a rank's experts see T*k
    copies whatever EP and ETP, ETP gathering ETP times the tokens for a 1/ETP shard of the weights) and the shared
    experts."""
    t, h = tokens_per_rank(s), s.hidden
    return (2 * t * h * moe["experts"] + _mlp_flops(t * moe["topk"], h, moe["moe_ffn"], s.gated_linear_unit)
            + shared_expert_flops(s, moe))


def mla_up_projection_flops(s: Settings) -> int:
    """Multi-latent attention's up projections per layer and microbatch on a TP rank, which ``mla_up_proj``
    recomputes: the query's from its latent (from the hidden state without one) to heads x (qk_head_dim +
    qk_pos_emb_head_dim), the keys' and values' from theirs to heads x (qk_head_dim + v_head_dim), column-parallel
    on the whole sequence (gathered under SP); the RoPE it repeats is elementwise."""
    m, tokens, heads = s.mla, s.seq_length * s.micro_batch, s.heads // s.tp
    query_in = s.hidden if m.q_lora_rank is None else m.q_lora_rank
    return 2 * tokens * heads * (query_in * m.q_head_dim + m.kv_lora_rank * (m.qk_head_dim + m.v_head_dim))


def recompute_flops_per_layer(module: str, s: Settings, moe: Optional[dict] = None) -> int:
    """Forward FLOPs one layer (of the kind ``module`` recomputes on) repeats per microbatch (GEMMs, 2 per MAC)."""
    seq, b, h, tp = s.seq_length, s.micro_batch, s.hidden, s.tp
    if module == "core_attn" and s.mla:  # QK^T over qk_head_dim + qk_pos_emb_head_dim, attention x V over v_head_dim
        return 2 * b * seq * seq * (s.heads // tp) * (s.mla.q_head_dim + s.mla.v_head_dim)
    if module == "core_attn":
        heads, d = s.heads // tp, s.kv_channels
        return 4 * b * seq * seq * heads * d  # QK^T and attention x V, full s x s (causal kernels skip about half)
    if module == "mla_up_proj" and s.mla:
        return mla_up_projection_flops(s)
    if module == "mlp":
        return _mlp_flops(seq * b, h, s.ffn // tp, s.gated_linear_unit)
    if module == "moe" and moe:
        return moe_layer_flops(s, moe)
    if module == "shared_experts" and moe:
        return shared_expert_flops(s, moe)
    return 0  # layernorm, moe_act: elementwise, no GEMM


def layers_for(module: str, s: Settings, moe: Optional[dict]) -> int:
    """The stage's layers that ``module`` recomputes on: dense MLPs for ``mlp``, MoE layers for the MoE modules,
    attention for ``core_attn`` and ``mla_up_proj``, and for the others (``layernorm``) every layer but a hybrid
    model's Mamba layers (Core's ``MambaLayer`` recomputes nothing)."""
    counts = layer_counts(s, moe)
    if module in MLP_MODULES:
        return counts.mlp
    if module in MOE_LAYER_MODULES:
        return counts.moe
    if module in ATTENTION_MODULES:
        return counts.attention
    return s.layers_on_stage - counts.mamba


def recompute_flops(s: Settings, modules: list[str], moe: Optional[dict] = None) -> int:
    """Forward FLOPs recomputing ``modules`` repeats per step on this rank's layers (``s``: estimate settings;
    ``moe``: :func:`~megatron_bridge_ext.levers.parallelism.cost.moe_shape` of an MoE model)."""
    return sum(recompute_flops_per_layer(m, s, moe) * layers_for(m, s, moe) for m in modules) * s.num_microbatches


def recompute_dispatch_bytes(s: Settings, modules: list[str], moe: Optional[dict], element: int) -> int:
    """Bytes a rank sends again per step when ``moe`` recompute repeats the forward dispatch and combine
    (:func:`~megatron_bridge_ext.levers.parallelism.cost.dispatch_bytes_per_layer`, forward only) per MoE layer
    and microbatch."""
    if "moe" not in modules or not moe:
        return 0
    per_layer = dispatch_bytes_per_layer(s, moe, ep=moe["ep"], etp=moe["etp"], element=element, passes=2)
    return per_layer * layer_counts(s, moe).moe * s.num_microbatches
