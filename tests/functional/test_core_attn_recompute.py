"""core_attn recompute on the tiny local-spec model (unfused attention): exact saving and the probe."""

import pytest
import torch

from megatron_bridge_ext.levers.recompute import attention
from megatron_bridge_ext.levers.recompute.probe import RecomputeProbe
from megatron_bridge_ext.measure import SavedActivationMeter
from megatron_bridge_ext.testing import tiny_model

SELECTIVE_CORE_ATTN = dict(recompute_granularity="selective", recompute_modules=["core_attn"])


def _one_step(shape, **overrides):
    model = tiny_model.apply_peft(tiny_model.build_gpt(shape, **overrides), tiny_model.bridge_lora(shape))
    with RecomputeProbe(model) as probe:
        with SavedActivationMeter(model) as meter:
            loss = tiny_model.loss_of(model, tiny_model.synthetic_batch(shape))
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return meter.result(), probe, loss.detach(), grads, model


def _dropout_mask_element_size(dtype: torch.dtype) -> int:
    """What torch's dropout keeps as its mask on this device, measured on a tiny call (CPU: the input's dtype)."""
    from megatron_bridge_ext.testing.distributed import device

    kept = []
    x = torch.ones(4, 4, dtype=dtype, device=device(), requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        torch.nn.functional.dropout(x * 1, 0.5, training=True)
    (mask,) = [t for t in kept if t.shape == x.shape]
    return mask.element_size()


@pytest.mark.parametrize("kv_heads, dropout", [(4, 0.0), (2, 0.0), (4, 0.1), (2, 0.1)],
                         ids=["MHA", "GQA", "MHA+dropout", "GQA+dropout"])
def test_core_attn_recompute_drops_exactly_the_attention_internal_tensors(tp2, kv_heads, dropout):
    """What selective core_attn recompute stops keeping, per layer, from the shapes (rank of TP=t=2):

    * the s x s tensors: the softmax output [b, a/t, s, s] and, with dropout, the dropout mask and
      output (Korthikanti et al.'s 5*a*s^2*b/t with 16-bit elements and CUDA's 1-byte mask);
    * the causal mask [s, s] (bool), which Megatron Core builds per layer;
    * minus the attention-mask-type tensor the checkpoint keeps (one int32);
    * with grouped-query attention (kv groups g/t < a/t heads): plus the repeated K and V copies
      [s, b, a/t, d] the kernel keeps, minus what the checkpoint keeps instead: K after RoPE
      [s, b, g/t, d] and the linear_qkv output [s, b, (a + 2g)/t * d] that its V is a view of.
      (With MHA those are the very tensors the kernel keeps either way.)
    """
    shape = tiny_model.TinyGPTShape(kv_heads=kv_heads)
    extra = {"attention_dropout": dropout}
    plain, plain_probe, plain_loss, plain_grads, model = _one_step(shape, **extra)
    ckpt, ckpt_probe, ckpt_loss, ckpt_grads, _ = _one_step(shape, **SELECTIVE_CORE_ATTN, **extra)

    element = 4  # float32
    s, b, t, d = shape.seq, shape.micro_batch, shape.tp, shape.hidden // shape.heads
    heads, groups = shape.heads // t, shape.kv_heads // t
    scores = attention.core_attn_bytes_per_layer(seq=s, micro_batch=b, heads=shape.heads, tp=t, element_size=element,
                                                 attention_dropout=dropout,
                                                 dropout_mask_element_size=_dropout_mask_element_size(torch.float32))
    causal_mask = s * s
    mask_type = torch.tensor([0], dtype=torch.int).element_size()
    gqa = 0
    if groups < heads:
        gqa = 2 * s * b * heads * d * element - s * b * groups * d * element - s * b * (heads + 2 * groups) * d * element
    expected = shape.layers * (scores + causal_mask - mask_type + gqa)

    assert plain.total_bytes - ckpt.total_bytes == expected
    assert plain.by_category["lora_input"] == ckpt.by_category["lora_input"]
    assert (plain_probe.checkpointed_forwards, plain_probe.recomputed) == (0, 0)
    assert (ckpt_probe.checkpointed_forwards, ckpt_probe.recomputed) == (shape.layers, shape.layers)
    assert torch.equal(plain_loss, ckpt_loss)  # dropout too: the checkpoint replays the RNG state
    assert plain_grads.keys() == ckpt_grads.keys()
    assert all(torch.equal(plain_grads[k], ckpt_grads[k]) for k in plain_grads)
    assert attention.attention_kind(model).kind == attention.UNFUSED
