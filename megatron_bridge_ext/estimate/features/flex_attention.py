"""A recipe's own core attention on torch's FlexAttention (Gemma 2), kept in the traced spec, by a stand-in that keeps
what the compiled kernel keeps.

Bridge's Gemma 2 spec builds ``Gemma2FlexDotProductAttention`` (``models/gemma/gemma2_provider.py`` L317-406, in
``gemma2_layer_spec`` L436-461). With no attention mask and no dropout (Bridge's ``gpt_step`` passes no mask unless
the dataset is asked for one, ``training/gpt_step.py`` L220-248, and Gemma 2's ``attention_dropout`` is 0) its
forward calls ``torch.compile(flex_attention)`` (L65, L381-401) with the logit softcap as its ``score_mod`` and the
causal or sliding-window mask as its ``block_mask`` (L348-362); otherwise it runs its unfused parent,
``Gemma2DotProductAttention`` (L94-314: scores, ``tanh`` softcap, Core's fused softmax, L402-406).

FlexAttention keeps no [s, s] matrix: its backward (torch 2.14 ``_higher_order_ops/flex_attention.py``,
``FlexAttentionBackwardHOP`` L130-172) reads q, k, v, the output, the fp32 log-sum-exp [b, heads, sq] and the block
mask's index tensors; its output has the query's layout (``flex_attention_fake_impl`` L602-637), so Bridge's
``permute(2, 0, 1, 3).contiguous()`` (L401) copies nothing and the output projection keeps the same storage.
(torch's eager autograd op also saves the row maxima, L815-827, which its backward does not read and the compiled
graph does not keep.) A compiled kernel does not run on fake tensors, so while a rank is traced :func:`kernels` puts
:func:`flex_attention` in Bridge's ``_flex_attn_func``; the block mask is torch's own ``create_block_mask``'s.

With ``--attention local`` the trace keeps the unfused parent, as a run with a mask or dropout would run it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

MODULES = ("megatron.bridge.models.gemma.gemma2_provider",)
"""Bridge's modules whose core attention calls their ``_flex_attn_func``."""


class _FlexAttentionSaves(torch.autograd.Function):
    """FlexAttention's saved set: q, k, v [b, heads, s, d] as given, the output [b, heads, sq, dv] in the query's
    layout, the fp32 log-sum-exp [b, heads, sq], the block mask's tensors."""

    @staticmethod
    def forward(ctx, query, key, value, *mask_tensors):
        if not isinstance(query, FakeTensor):
            raise RuntimeError("the FlexAttention stand-in models the kernel's saved tensors on fake tensors only; "
                               "it computes no attention")
        b, heads, sq, _ = query.shape
        order = sorted(range(4), key=lambda dim: -query.stride(dim))
        shape = (b, heads, sq, value.shape[-1])
        out = query.new_empty([shape[dim] for dim in order]).permute([order.index(dim) for dim in range(4)])
        lse = torch.empty(b, heads, sq, dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse, *mask_tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value = ctx.saved_tensors[:3]
        masks = len(ctx.saved_tensors) - 5
        return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)) + (None,) * masks


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale: Optional[float] = None,
                   enable_gqa: bool = False):
    """Bridge's call of the compiled ``flex_attention`` (``gemma2_provider.py`` L392-400), by the stand-in."""
    mask_tensors = [t for t in (block_mask.as_tuple()[:-1] if block_mask is not None else ())
                    if isinstance(t, torch.Tensor)]
    return _FlexAttentionSaves.apply(query, key, value, *mask_tensors)


def is_flex_class(cls) -> bool:
    """A core attention of one of :data:`MODULES` with a FlexAttention path (its ``_build_flex_block_mask``), in a
    module where FlexAttention imported (``_HAVE_FLEX_ATTN``, L57-74)."""
    module = sys.modules.get(getattr(cls, "__module__", ""), None)
    return (isinstance(cls, type) and cls.__module__ in MODULES and hasattr(cls, "_build_flex_block_mask")
            and bool(getattr(module, "_HAVE_FLEX_ATTN", False)))


def unfused_class(cls) -> type:
    """The unfused attention a FlexAttention class falls back to: its base (``Gemma2DotProductAttention``)."""
    return cls.__bases__[0]


@contextlib.contextmanager
def kernels() -> Iterator[None]:
    """While it lasts, each loaded module of :data:`MODULES` calls :func:`flex_attention` for its compiled kernel."""
    saved = {name: sys.modules[name]._flex_attn_func for name in MODULES
             if getattr(sys.modules.get(name), "_flex_attn_func", None) is not None}
    for name in saved:
        sys.modules[name]._flex_attn_func = flex_attention
    try:
        yield
    finally:
        for name, function in saved.items():
            sys.modules[name]._flex_attn_func = function


def used(model) -> bool:
    """Whether the recipe's spec has a FlexAttention core attention."""
    from megatron_bridge_ext.estimate.features import recipe_attention

    return is_flex_class(recipe_attention.spec_core_attention(model))


NOTE = ("torch FlexAttention (the recipe's own core attention, compiled): by a stand-in that keeps q, k, v, the output, "
        "the fp32 log-sum-exp and the block mask, as its backward reads them (estimate.features.flex_attention)")
