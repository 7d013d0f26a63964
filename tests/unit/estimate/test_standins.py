"""The fused core-attention stand-in: it keeps what the fused kernels keep, on fake tensors only."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.unit]


def test_fused_attention_stand_in_keeps_what_the_fused_kernels_keep():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_bridge_ext.estimate.standins import _FusedAttentionSaves
    from megatron_bridge_ext.measure import SavedActivationMeter

    s, b, heads, groups, d = 64, 2, 8, 2, 16
    with FakeTensorMode():
        q = torch.empty(s, b, heads, d, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.empty(s, b, 2 * groups, d, dtype=torch.bfloat16, requires_grad=True)
        k, v = kv[:, :, :groups], kv[:, :, groups:]  # v a view, made contiguous by the kernel
        with SavedActivationMeter() as meter:
            out = _FusedAttentionSaves.apply(q, k, v)
    assert tuple(out.shape) == (s, b, heads * d)
    expected = (s * b * heads * d * 2  # q
                + s * b * 2 * groups * d * 2  # k: a view of kv keeps kv's storage
                + s * b * groups * d * 2  # contiguous v
                + s * b * heads * d * 2  # output
                + b * heads * s * 4)  # fp32 log-sum-exp
    assert meter.result().total_bytes == expected


def test_fused_attention_stand_in_refuses_real_tensors():
    import torch

    from megatron_bridge_ext.estimate.standins import _FusedAttentionSaves

    x = torch.zeros(4, 1, 2, 8)
    with pytest.raises(RuntimeError, match="fake tensors only"):
        _FusedAttentionSaves.apply(x, x, x)


def test_fused_attention_stand_in_takes_keys_wider_than_values():
    """Multi-latent attention: q and k of qk_head_dim + qk_pos_emb_head_dim per head, v of v_head_dim; the output
    has the value's width (TE's kv_channels pair), and the stand-in takes Core's k_channels / v_channels."""
    from types import SimpleNamespace

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_bridge_ext.estimate.standins import FusedAttentionStandIn
    from megatron_bridge_ext.measure import SavedActivationMeter

    s, b, heads, d_qk, d_v = 32, 2, 4, 24, 12
    attention = FusedAttentionStandIn(SimpleNamespace(), 1, None, "self", softmax_scale=0.2, k_channels=d_qk,
                                      v_channels=d_v)
    with FakeTensorMode():
        q = torch.empty(s, b, heads, d_qk, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(s, b, heads, d_qk, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(s, b, heads, d_v, dtype=torch.bfloat16, requires_grad=True)
        with SavedActivationMeter() as meter:
            out = attention(q, k, v, None)
    assert tuple(out.shape) == (s, b, heads * d_v)
    assert meter.result().total_bytes == (2 * s * b * heads * d_qk * 2 + s * b * heads * d_v * 2  # q, k, v
                                          + s * b * heads * d_v * 2 + b * heads * s * 4)  # output, fp32 lse
