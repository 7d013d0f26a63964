"""Gemma 2's FlexAttention core attention in the estimate: Bridge's class kept, its compiled kernel by a stand-in that
keeps q, k, v, the output, the fp32 log-sum-exp and the block mask (bytes from the shapes; the output's and the
log-sum-exp's shapes, dtypes and layout as torch's own FlexAttention gives them)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.unit]

S, B, HEADS, GROUPS, D = 256, 2, 4, 2, 16
BF16, FP32, INT32 = 2, 4, 4
BLOCK = 128
"""torch's default FlexAttention block (``_DEFAULT_SPARSE_BLOCK_SIZE``)."""


@pytest.fixture(scope="module")
def gemma2():
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.models.gemma import gemma2_provider

    return gemma2_provider


def _provider(gemma2):
    return gemma2.Gemma2ModelProvider(num_layers=2, hidden_size=HEADS * D, num_attention_heads=HEADS,
                                      num_query_groups=GROUPS, kv_channels=D, ffn_hidden_size=128,
                                      window_size=(63, 0))


def _fake_world():
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_bridge_ext.estimate.fake import fake_parallel_world

    stack = contextlib.ExitStack()
    stack.enter_context(fake_parallel_world(tp=1, pp=1, cp=1, rank=0, device="cuda"))
    stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    return stack


def _qkv():
    """Core's layout [s, b, heads, d] (queries) and [s, b, groups, d] (keys, values), bf16, requiring grad."""
    def tensor(heads):
        return torch.empty(S, B, heads, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    return tensor(HEADS), tensor(GROUPS), tensor(GROUPS)


def _mask_bytes() -> int:
    """A block mask's eight int32 tensors: four block counts [1, 1, n] and four index tables [1, 1, n, n]."""
    n = math.ceil(S / BLOCK)
    return 4 * n * INT32 + 4 * n * n * INT32


@pytest.mark.parametrize("layer_number", [1, 2])  # Gemma 2: odd layers slide, even ones attend globally
def test_gemma2_flex_attention_keeps_qkv_output_lse_and_block_mask(gemma2, layer_number):
    from megatron_bridge_ext.estimate.features import flex_attention
    from megatron_bridge_ext.measure import SavedActivationMeter

    with _fake_world(), flex_attention.kernels():
        attention = gemma2.Gemma2FlexDotProductAttention(_provider(gemma2), layer_number, None, "self")
        query, key, value = _qkv()
        with SavedActivationMeter() as meter:
            out = attention(query, key, value, None)
    assert out.shape == (S, B, HEADS * D)
    qkv = (S * B * HEADS * D + 2 * S * B * GROUPS * D) * BF16
    output = S * B * HEADS * D * BF16  # the output projection's input: the same storage
    lse = B * HEADS * S * FP32
    assert meter.result().total_bytes == qkv + output + lse + _mask_bytes()


def test_stand_in_output_and_lse_are_torchs():
    """torch's FlexAttention operator on fake tensors (``flex_attention_fake_impl``) gives the output in the query's
    layout and an fp32 log-sum-exp [b, heads, s]: the stand-in's are the same."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_operator
    from torch.nn.attention.flex_attention import create_block_mask

    from megatron_bridge_ext.estimate.features import flex_attention

    with _fake_world():
        q, k, v = (t.permute(1, 2, 0, 3) for t in _qkv())
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, S, S, device="cuda")
        with torch.no_grad():
            out, lse, _ = flex_operator(q, k, v, lambda score, *index: score, mask.as_tuple(), 1.0, {})
        ours = flex_attention.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        saved_lse = ours.grad_fn.saved_tensors[4]
    assert (ours.shape, ours.stride(), ours.dtype) == (out.shape, out.stride(), out.dtype)
    assert (saved_lse.shape, saved_lse.dtype) == (lse.shape, lse.dtype) == ((B, HEADS, S), torch.float32)


def test_gemma2_run_uses_flex_attention_and_local_keeps_its_unfused_parent(gemma2):
    """Bridge's Gemma 2 spec: FlexAttention, which keeps no s x s matrix (fused, for the estimate and the recompute
    advice); ``--attention local`` traces the class it falls back to."""
    from megatron_bridge_ext.estimate.features import recipe_attention
    from megatron_bridge_ext.levers.recompute import attention

    provider = _provider(gemma2)
    assert attention.attention_kind_from_config(provider).kind == attention.FUSED
    assert recipe_attention.own_core_attention(provider, fused=True) is gemma2.Gemma2FlexDotProductAttention
    assert recipe_attention.own_core_attention(provider, fused=False) is gemma2.Gemma2DotProductAttention
