"""A fused core attention for the local layer spec: PyTorch's ``scaled_dot_product_attention``.

Megatron Core's local ``DotProductAttention`` materialises the [b, a/t, s, s] softmax output, which
dominates activation memory at long sequences (4 GiB per layer in fp32 at s=8192) and is not what
users run: their attention is fused (TE's flash/cuDNN backends), keeping q, k, v, the output and a
log-sum-exp per row. This module gives the local spec that behaviour without Transformer Engine, so
that peak-memory measurements on one GPU (``scripts/device_check.sh``) see a realistic stack. On CUDA
with 16-bit inputs PyTorch dispatches to its flash or memory-efficient kernel; on a CPU it falls
back to the math implementation (correct, not memory-faithful: dry runs only).

Causal self-attention only (the GPT layer specs); no dropout, no attention bias, no packed sequences.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


class SDPAttention(torch.nn.Module):
    """Drop-in for Megatron Core's core attention submodule (``SelfAttentionSubmodules.core_attention``)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"SDPAttention has no attention dropout (attention_dropout={dropout}); set it to 0")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention computes causal attention only, got {attn_mask_type}")
        self.config = config
        self.layer_number = layer_number
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """[s, b, heads, d] query and [s, b, groups, d] key/value -> [s, b, heads * d]."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention supports neither attention bias nor packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def local_spec_with_sdpa():
    """Megatron Core's local GPT layer spec with :class:`SDPAttention` as core attention."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
