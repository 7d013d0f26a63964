"""A core attention that computes causal attention on real tensors and keeps, for backward, what a fused kernel keeps.

The estimate traces attention with a stand-in that keeps what Transformer Engine's fused attention keeps, q, k, v,
the output and the fp32 softmax statistics, and computes nothing (:mod:`megatron_bridge_ext.estimate.standins`).
Multi-latent attention cannot run on Megatron Core's local ``DotProductAttention`` (it takes no ``k_channels`` /
``v_channels``), so a real run of a tiny multi-latent model needs an attention that does run: this one. Its saved
set is the stand-in's, TE's cuDNN ``FusedAttnFunc`` (TE v2.17.1 ``attention/dot_product_attention/backends.py``
L1538 and L1560-1569: ``(q, k, v, out)`` and the softmax statistics [b, heads, sq, 1] in fp32,
``cpp_extensions/fused_attn.py`` L247-254), so that a measured run compares with the estimate everywhere but in
attention's own kernel. Its backward runs the forward again with autograd (the kernel's backward works from the same
saved set).

Causal self-attention, keys and values with one head per query head (multi-latent attention's), no dropout.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def _attention(query, key, value, scale: float):
    """q, k [s, b, heads, d_qk] and v [s, b, heads, d_v] -> output [s, b, heads * d_v], fp32 lse [b, heads, s]."""
    q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, heads, s, d]
    scores = q @ k.transpose(-1, -2) * scale
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ v
    s, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1).to(query.dtype), lse


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale):
        value = value.contiguous()
        out, lse = _attention(query, key, value, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _, _ = ctx.saved_tensors
        inputs = [t.detach().requires_grad_() for t in (query, key, value)]
        with torch.enable_grad():
            out, _ = _attention(*inputs, ctx.scale)
        grads = torch.autograd.grad(out, inputs, grad_out)
        return (*grads, None)


class CpuFusedAttention(torch.nn.Module):
    """Drop-in for Megatron Core's core attention submodule of multi-latent attention (``MLASelfAttentionSubmodules
    .core_attention``), with the constructor arguments of Core's ``TEDotProductAttention``."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout or attn_mask_type != AttnMaskType.causal:
            raise ValueError("CpuFusedAttention computes causal attention without dropout only")
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("CpuFusedAttention supports neither attention bias nor packed sequences")
        return _FusedAttention.apply(query, key, value, self.softmax_scale)
