"""Transformer Engine's parallel cross entropy (``cross_entropy_fusion_impl="te"``), by a stand-in that keeps what it
keeps.

With ``cross_entropy_loss_fusion`` and ``cross_entropy_fusion_impl="te"`` Core's language model computes its loss with
TE's ``parallel_cross_entropy`` (``language_module.py`` L168-190, through ``te_parallel_cross_entropy``,
``extensions/transformer_engine.py`` L3490-3503); without Transformer Engine Core raises "Trying to use a TE block
when it's not present" (L189-190). TE v2.17.1's ``CrossEntropyFunction`` (``transformer_engine/pytorch/
cross_entropy.py`` L53-64) runs its Triton kernels on the rank's [s, b, V / t] logits shard
(``pytorch/triton/cross_entropy.py`` L26-111): a contiguous copy first only where the shard is not contiguous in
its last two dimensions (L52-53); ``cross_entropy_kernel`` computes the loss and writes the gradient of the logits
over them, in their dtype (``common/triton/cross_entropy.py`` L167-190); the fp32 row statistics it gathers
(L44-49, L78-84) are dropped when the forward returns. The function saves that tensor, the logits' own storage,
now holding the gradient (``cross_entropy.py`` L62), and its backward scales it in place (L78-79, triton
L114-140). It returns the fp32 loss [s, b].

:func:`kernels` puts :func:`parallel_cross_entropy` in the place of Core's ``te_parallel_cross_entropy`` while a
rank's model is traced: the logits' storage is kept, in the training dtype, where Core's native fused loss keeps
an fp32 copy of its softmax.

It models the kernel's saved set for tracing on fake tensors only: no numerics.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class _CrossEntropySaves(torch.autograd.Function):
    """The logits (made contiguous only where TE's wrapper copies them) kept for backward; an fp32 loss shaped as
    the labels returned."""

    @staticmethod
    def forward(ctx, logits, labels):
        vocab = logits.shape[-1]
        if logits.stride(-1) != 1 or logits.stride(-2) != vocab:
            logits = logits.contiguous()
        ctx.save_for_backward(logits.detach())
        return torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)

    @staticmethod
    def backward(ctx, grad_loss):
        (gradient,) = ctx.saved_tensors
        return gradient, None


def parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                           is_cg_capturable: bool = False) -> torch.Tensor:
    """Core's ``te_parallel_cross_entropy`` signature; the loss [s, b] of the rank's [s, b, V / t] logits."""
    return _CrossEntropySaves.apply(logits, labels)


def used(model) -> bool:
    return bool(getattr(model, "cross_entropy_loss_fusion", False)) and \
        getattr(model, "cross_entropy_fusion_impl", "native") == "te"


@contextlib.contextmanager
def kernels() -> Iterator[None]:
    """While it lasts, Core's language model computes a TE-fused loss with :func:`parallel_cross_entropy`."""
    from megatron.core.models.common.language_module import language_module

    saved = language_module.te_parallel_cross_entropy
    language_module.te_parallel_cross_entropy = parallel_cross_entropy
    try:
        yield
    finally:
        language_module.te_parallel_cross_entropy = saved


NOTE = ("cross_entropy_fusion_impl='te': Transformer Engine's parallel cross entropy by a stand-in that keeps what it "
        "keeps, the logits' storage with their gradient written over them in the training dtype "
        "(estimate.features.cross_entropy)")
