"""Core's fused softmax on the stand-ins for Apex's kernels: the 16-bit output and the host scale kept, as Core's
autograd functions keep what Apex's kernels return."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.unit]

B, HEADS, S = 2, 4, 64
HOST_SCALE = 4
"""Core's ``torch.tensor([scale])``: one fp32 element on the host."""


@pytest.mark.parametrize("sk, expected", [(4096, 128 // 32 * 1), (64, 128 // 32 * 2), (20, 128 // 32 * 2),
                                          (16, 128 // 16 * 2)])
def test_batch_per_block_is_apex_formula(sk, expected):
    """Threads per row: the keys' next power of two, a 32-thread warp at most; rows per warp 2 up to 128 keys."""
    from megatron_bridge_ext.estimate.features.softmax import batch_per_block

    assert batch_per_block(S, sk, B, HEADS) == expected


def _softmax(mask_type, *, window=None, fusion=True):
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.utils import attention_mask_func

    return FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=mask_type,
                                 scaled_masked_softmax_fusion=fusion, mask_func=attention_mask_func,
                                 softmax_in_fp32=True, scale=None, window_size=window)


def _saved(softmax, scores, mask=None) -> int:
    from megatron_bridge_ext.estimate.features.softmax import kernels
    from megatron_bridge_ext.measure import SavedActivationMeter

    with kernels(), SavedActivationMeter() as meter:
        probs = softmax(scores, mask)
    assert probs.shape == scores.shape and probs.dtype == scores.dtype
    return meter.result().total_bytes


@pytest.mark.parametrize("window", [None, (15, 0)])
@pytest.mark.parametrize("fake", [True, False])
def test_causal_kernel_keeps_its_16_bit_output(fake, window):
    """Core's ScaledUpperTriangMaskedSoftmax with the stand-in: [b, heads, s, s] in bf16 and the host scale, on fake
    tensors (the trace) as on real CPU tensors (Core's function run as it is); a sliding window changes nothing."""
    import contextlib

    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        scores = torch.empty(B, HEADS, S, S, dtype=torch.bfloat16, requires_grad=True)
        saved = _saved(_softmax(AttnMaskType.causal, window=window), scores)
    assert saved == B * HEADS * S * S * 2 + HOST_SCALE


def test_masked_kernel_keeps_its_16_bit_output():
    """A mask given (Gemma 2's sliding-window layers, ``AttnMaskType.arbitrary``): Core's ScaledMaskedSoftmax keeps
    the same output; the mask is read, not kept."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        scores = torch.empty(B, HEADS, S, S, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(1, 1, S, S, dtype=torch.bool)
        saved = _saved(_softmax(AttnMaskType.arbitrary), scores, mask)
    assert saved == B * HEADS * S * S * 2 + HOST_SCALE


def test_torch_path_keeps_fp32_probabilities_where_the_kernel_does_not_fit():
    """Keys beyond 4096 (or fusion off): Core's torch softmax, whose fp32 output is what it keeps, twice the
    kernel's bytes per element."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        scores = torch.empty(B, HEADS, S, S, dtype=torch.bfloat16, requires_grad=True)
        saved = _saved(_softmax(AttnMaskType.arbitrary, fusion=False), scores)
    assert saved == B * HEADS * S * S * 4


def test_kernels_put_back_what_was_there():
    import sys

    from megatron_bridge_ext.estimate.features.softmax import MODULES, kernels

    with kernels():
        assert all(name in sys.modules for name in MODULES)
    assert not any(name in sys.modules for name in MODULES)
