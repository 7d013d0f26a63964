"""A core-attention stand-in that keeps, for backward, what a fused attention kernel keeps.

Production runs use Transformer Engine's fused attention (FlashAttention-2 or cuDNN): it keeps no
[s, s] matrix, only its inputs q, k, v, its output and the fp32 softmax log-sum-exp per query
[b, heads, s] (FlashAttention's ``softmax_lse``; cuDNN's softmax statistics). Transformer Engine
cannot run here, and Megatron Core's local ``DotProductAttention`` materialises the [b, heads, s, s]
probabilities, which no such user keeps. The estimate therefore traces the local layer spec with
this module in place of ``core_attention`` (``attention="fused"``, the default) and says so in its
assumptions; ``attention="local"`` traces Core's own unfused attention instead.

Multi-latent attention (:mod:`.features.mla`) hands it keys wider than its values: q and k of
``qk_head_dim + qk_pos_emb_head_dim`` per head, v of ``v_head_dim``. Transformer Engine's fused
attention takes the two widths apart (``DotProductAttention``'s ``kv_channels`` pair, TE v2.17.1
``dot_product_attention.py`` L424-429) and its output has the value's width per head; cuDNN's
``FusedAttnFunc`` keeps ``(q, k, v, out)`` and its fp32 softmax statistics [b, heads, sq, 1]
(``backends.py`` L1538 and L1560-1569, ``cpp_extensions/fused_attn.py`` L247-254).

With context parallelism (``context_parallel_size`` > 1) it saves what Transformer Engine's CP kernel for the layer's
``cp_comm_type`` saves instead (:mod:`.features.context_parallel`).

It is a model of the kernels' saved set, for tracing on fake tensors only: no numerics.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from megatron.core.transformer.module import MegatronModule


class _FusedAttentionSaves(torch.autograd.Function):
    """Causal attention that saves q, k, v (contiguous), out [sq, b, np * hn_v] and fp32 lse [b, np, sq]: the output
    has the value's head width, which multi-latent attention makes narrower than the query's."""

    @staticmethod
    def forward(ctx, query, key, value):
        if not isinstance(query, FakeTensor):
            raise RuntimeError("FusedAttentionStandIn models a fused kernel's saved tensors on fake tensors only; "
                               "it computes no attention")
        sq, b, heads, _ = query.shape
        value = value.contiguous()  # the kernels take a contiguous V; Q and K arrive contiguous from RoPE
        out = query.new_empty(sq, b, heads * value.shape[-1])
        lse = torch.empty(b, heads, sq, dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


class FusedAttentionStandIn(MegatronModule):
    """Takes the place of ``DotProductAttention`` in the local layer spec (causal self-attention); it takes
    the constructor arguments of Core's ``TEDotProductAttention`` (multi-latent attention passes the key and value
    widths, ``k_channels`` and ``v_channels``) and ignores them: the saved set depends on the shapes only."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        from megatron_bridge_ext.estimate.features.context_parallel import Kernel

        self.cp_kernel = Kernel.of(config, cp_comm_type)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.cp_kernel is not None:
            from megatron_bridge_ext.estimate.features import context_parallel

            return context_parallel.attention(query, key, value, self.cp_kernel)
        return _FusedAttentionSaves.apply(query, key, value)


@contextlib.contextmanager
def replaced_attributes(replaced: dict) -> Iterator[None]:
    """Each ``(module, name)`` of ``replaced`` set to its value for the block, and put back after it: how a stand-in
    takes a kernel's place in the module that calls it while a rank is traced."""
    saved = {key: getattr(*key) for key in replaced}
    for (module, name), value in replaced.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
