"""Core's fused scale-mask-softmax: Apex's Megatron softmax kernels, by stand-ins that keep what they keep.

Megatron Core's ``FusedScaleMaskSoftmax`` (``fusions/fused_softmax.py``), with which Core's local
``DotProductAttention`` and Bridge's Gemma 2 attention normalise their scores, runs Apex's CUDA extensions when
``masked_softmax_fusion`` is set and the shapes fit (``is_kernel_available``, L238-270: 16-bit scores,
16 < sk <= 4096, sq, sk and b x heads multiples of 4, and the kernel's batches per block dividing b x heads when
causal, sq otherwise); else torch's softmax in fp32 (L299-342). Those extensions are built for CUDA and do not import
here, so while a rank's model is traced :func:`kernels` puts modules of the same names in their place:

* ``scaled_upper_triang_masked_softmax_cuda`` (causal, Core's ``ScaledUpperTriangMaskedSoftmax``, L19-37; it reads
  no mask, so a sliding window, Core's ``window_size``, changes nothing it keeps), ``scaled_masked_softmax_cuda``
  (a mask given, ``ScaledMaskedSoftmax``, L68-87: Gemma 2's sliding-window layers pass theirs) and
  ``scaled_softmax_cuda`` (neither, ``ScaledSoftmax``, L115-133). Each ``forward`` returns a new tensor of the
  input's shape and 16-bit dtype, as Apex allocates its output (NVIDIA/apex@6424da3
  ``csrc/megatron/scaled_upper_triang_masked_softmax_cuda.cu`` L40, ``scaled_masked_softmax_cuda.cu`` L52,
  ``scaled_softmax_cuda.cu`` L43); ``backward`` returns the input gradient (the causal kernel writes it over the
  output gradient, L53-74 of its file; the others allocate it).
* ``get_batch_per_block``: Apex's formula (``csrc/megatron/scaled_masked_softmax.h`` L421-433), which Core's
  availability check reads.

Core's autograd functions run unchanged: they save that output and the scale as a one-element host fp32 tensor
(``fused_softmax.py`` L33-36, L83-86, L129-132). Per layer the kernel keeps [b, heads / t, sq, sk] in the 16-bit
dtype, where torch's path keeps the fp32 softmax output of the same shape. Scores capped before the softmax (Gemma
2's ``attn_logit_softcapping``, ``scale * tanh(scores / scale)``) reach the kernel as any scores do; what the cap
itself keeps is the traced ``tanh``'s.

It models the kernels' saved sets for tracing on fake tensors only: no numerics.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator

import torch

WARP_SIZE = 32
"""``C10_WARP_SIZE`` on NVIDIA GPUs."""
THREADS_PER_BLOCK = 128
"""Apex's ``threads_per_block`` (``scaled_masked_softmax.h`` L428)."""
MAX_KEYS = 4096
"""The longest key sequence Core hands the kernels (``fused_softmax.py`` L256)."""


def batch_per_block(sq: int, sk: int, b: int, heads: int) -> int:
    """Rows of scores one CUDA block of Apex's kernels normalises (``scaled_masked_softmax.h`` L421-433): the keys'
    next power of two sets the threads per row (a warp at most) and rows per warp (2 up to 128 keys, else 1)."""
    next_power_of_two = 1 << max(sk - 1, 0).bit_length()
    warp = min(next_power_of_two, WARP_SIZE)
    per_warp = 2 if next_power_of_two <= 128 else 1
    return THREADS_PER_BLOCK // warp * per_warp


def _new_output(inputs: torch.Tensor, *args) -> torch.Tensor:
    """The kernels' softmax output: a new tensor of the scores' shape and dtype."""
    return torch.empty(inputs.shape, dtype=inputs.dtype, device=inputs.device)


def _input_grad(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale) -> torch.Tensor:
    return torch.empty(output_grads.shape, dtype=output_grads.dtype, device=output_grads.device)


def _module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name, "A stand-in for Apex's CUDA extension of this name (estimate.features.softmax)")
    module.__dict__.update(forward=_new_output, backward=_input_grad, **functions)
    return module


MODULES = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")
"""The extensions Core imports inside ``fused_softmax.py``."""


@contextlib.contextmanager
def kernels() -> Iterator[None]:
    """While it lasts, Core's ``import`` of each Apex softmax extension finds its stand-in (an installed extension,
    a GPU machine's, cannot take fake tensors either); what was there before is put back."""
    saved = {name: sys.modules.get(name) for name in MODULES}
    for name in MODULES:
        extra = {"get_batch_per_block": batch_per_block} if name == "scaled_masked_softmax_cuda" else {}
        sys.modules[name] = _module(name, **extra)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def used(model) -> bool:
    """Whether Core asks for the fused kernels (they then run where the shapes fit)."""
    return bool(getattr(model, "masked_softmax_fusion", False))


NOTE = ("masked_softmax_fusion: Core's fused softmax (Apex's kernels, where the shapes fit: 16-bit scores, "
        "16 < s <= 4096) by stand-ins that keep its 16-bit output, as the kernels do (estimate.features.softmax)")
