"""Transformer Engine's fused MoE router (``moe_router_fusion=True``), by stand-ins that keep what its kernels keep.

With ``moe_router_fusion`` Core's router calls three TE functions (``transformer/moe/moe_utils.py``: L772-791 the
top-k with its score function, L921-935 the scores for the auxiliary loss, L127-137 the auxiliary loss), which
Core imports from TE >= 2.7 (``extensions/transformer_engine.py`` L3559-3568) and without TE refuses ("is not
available"). What TE v2.17.1 keeps for backward (``transformer_engine/pytorch/router.py``), with the shapes its
extension allocates (``pytorch/csrc/extensions/router.cpp``) for [T, E] logits (T tokens, E experts) and Core's
default byte routing map:

* ``fused_topk_with_score_function``: the routing map, bool [T, E], and the fp32 intermediate scores [T, E]
  (router.py L88-99; router.cpp L63-66); it returns the probabilities [T, E] in the logits' dtype and the map;
* ``fused_compute_score_for_moe_aux_loss``: the fp32 intermediate scores [T, E] (router.py L204-210; router.cpp
  L155-158); it returns the map and the fp32 scores [T, E];
* ``fused_moe_aux_loss``: its two-element fp32 constant buffer and ``tokens_per_expert`` (router.py L285-295;
  router.cpp L226-227); it returns a scalar in the probabilities' dtype.

:func:`kernels` puts them in Core's place while a rank's model is traced (and says to Core's checks that TE is
there); the routing itself stays the stated load of :mod:`..routing`. For tracing on fake tensors only: no
numerics.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


def _like(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(logits.shape, dtype=dtype, device=logits.device)


class _TopkSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        routing_map, intermediate = _like(logits, torch.bool), _like(logits, torch.float32)
        ctx.save_for_backward(routing_map, intermediate)
        ctx.mark_non_differentiable(routing_map)
        return _like(logits, logits.dtype), routing_map

    @staticmethod
    def backward(ctx, grad_probs, _):
        return torch.empty_like(grad_probs)


class _ScoresSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        intermediate = _like(logits, torch.float32)
        ctx.save_for_backward(intermediate)
        ctx.logits_dtype = logits.dtype
        routing_map = _like(logits, torch.bool)
        ctx.mark_non_differentiable(routing_map)
        return routing_map, _like(logits, torch.float32)

    @staticmethod
    def backward(ctx, _, grad_scores):
        return torch.empty(grad_scores.shape, dtype=ctx.logits_dtype, device=grad_scores.device)


class _AuxLossSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, tokens_per_expert):
        ctx.save_for_backward(torch.empty(2, dtype=torch.float32, device=probs.device), tokens_per_expert)
        ctx.shape = probs.shape
        return torch.empty((), dtype=probs.dtype, device=probs.device)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device), None


def fused_topk_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool,
                                   num_groups: Optional[int], group_topk: Optional[int],
                                   scaling_factor: Optional[float], score_function: str,
                                   expert_bias: Optional[torch.Tensor]):
    """TE's signature as Core calls it: (probabilities, routing map), each [T, E]."""
    return _TopkSaves.apply(logits)


def fused_compute_score_for_moe_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """TE's signature as Core calls it: (routing map, fp32 scores), each [T, E]."""
    return _ScoresSaves.apply(logits)


def fused_moe_aux_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                       num_experts: int, topk: int, coeff: float) -> torch.Tensor:
    """TE's signature as Core calls it: the scalar auxiliary loss."""
    return _AuxLossSaves.apply(probs, tokens_per_expert)


def used(model) -> bool:
    return bool(getattr(model, "num_moe_experts", None)) and bool(getattr(model, "moe_router_fusion", False))


@contextlib.contextmanager
def kernels() -> Iterator[None]:
    """While it lasts, Core's MoE utilities call the stand-ins for TE's fused router functions."""
    from megatron.core.transformer.moe import moe_utils

    replaced = {"HAVE_TE": True, "fused_topk_with_score_function": fused_topk_with_score_function,
                "fused_compute_score_for_moe_aux_loss": fused_compute_score_for_moe_aux_loss,
                "fused_moe_aux_loss": fused_moe_aux_loss}
    saved = {name: getattr(moe_utils, name) for name in replaced}
    for name, value in replaced.items():
        setattr(moe_utils, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(moe_utils, name, value)


NOTE = ("moe_router_fusion: Transformer Engine's fused router by stand-ins that keep what its kernels keep: the bool "
        "routing map and fp32 scores [tokens, experts] per router (estimate.features.router)")
