"""core_attn recompute on the tiny local-spec model (unfused attention): exact saving and the probe."""

import torch

from megatron_bridge_ext import recompute
from megatron_bridge_ext.demo import tiny_model
from megatron_bridge_ext.measure import RecomputeProbe, SavedActivationMeter

SELECTIVE_CORE_ATTN = dict(recompute_granularity="selective", recompute_modules=["core_attn"])


def _one_step(shape, **overrides):
    model = tiny_model.apply_peft(tiny_model.build_gpt(shape, **overrides), tiny_model.bridge_lora(shape))
    with RecomputeProbe(model) as probe:
        with SavedActivationMeter(model) as meter:
            loss = tiny_model.loss_of(model, tiny_model.synthetic_batch(shape))
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return meter.result(), probe, loss.detach(), grads, model


def test_core_attn_recompute_drops_exactly_the_attention_internal_tensors(tp2):
    """Multi-head attention (kv_heads == heads): Q, K and V reach the kernel as views of tensors that are
    kept either way, so the difference is exactly the s x s tensors (no dropout: the softmax output),
    the shared causal mask, minus the small mask-type tensor the checkpoint keeps per layer. With
    grouped-query attention the kernel's expanded K/V copies and the checkpoint's inputs differ in
    layout too, and the difference is no longer only the s x s tensors."""
    shape = tiny_model.TinyGPTShape(kv_heads=4)
    plain, plain_probe, plain_loss, plain_grads, model = _one_step(shape)
    ckpt, ckpt_probe, ckpt_loss, ckpt_grads, _ = _one_step(shape, **SELECTIVE_CORE_ATTN)

    element = 4  # float32
    heads_local = shape.heads // shape.tp
    softmax_out = recompute.core_attn_bytes_per_layer(seq=shape.seq, micro_batch=shape.micro_batch, heads=shape.heads,
                                                      tp=shape.tp, element_size=element)
    assert softmax_out == shape.micro_batch * heads_local * shape.seq**2 * element
    causal_mask = shape.seq * shape.seq  # bool, built once and shared by every layer
    mask_type = torch.tensor([0], dtype=torch.int).element_size()  # the checkpoint keeps one per layer
    expected = shape.layers * (softmax_out - mask_type) + causal_mask

    assert plain.total_bytes - ckpt.total_bytes == expected
    assert plain.by_category["lora_input"] == ckpt.by_category["lora_input"]
    assert (plain_probe.checkpointed_forwards, plain_probe.recomputed) == (0, 0)
    assert (ckpt_probe.checkpointed_forwards, ckpt_probe.recomputed) == (shape.layers, shape.layers)
    assert torch.equal(plain_loss, ckpt_loss)
    assert plain_grads.keys() == ckpt_grads.keys()
    assert all(torch.equal(plain_grads[k], ckpt_grads[k]) for k in plain_grads)
    assert recompute.attention_kind(model).kind == recompute.UNFUSED
