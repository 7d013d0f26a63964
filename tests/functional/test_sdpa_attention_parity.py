"""The fused core attention of the device check (PyTorch SDPA) computes what Megatron Core's local
``DotProductAttention`` computes: same loss and same weight gradients, in float64, at TP=2 with sequence
parallelism, RMSNorm and grouped-query attention (2 query heads per KV head on each rank).

In float64 both are exact up to summation order, so anything above 1e-10 relative error is a real
difference (scale, head grouping, causal mask or layout), not rounding.
"""

from __future__ import annotations

import torch

from megatron_bridge_ext.testing import sdpa_attention
from megatron_bridge_ext.testing import tiny_model as tm
from tests.support.dist_checks import assert_no_problems, local_rel_err

SHAPE = tm.TinyGPTShape(layers=2, hidden=64, ffn=128, heads=8, kv_heads=2, seq=32, micro_batch=2, dtype="float64",
                        swiglu=True)


def _loss_and_grads(layer_spec) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = tm.build_gpt(SHAPE, layer_spec=layer_spec, normalization="RMSNorm")
    loss = tm.loss_of(model, tm.synthetic_batch(SHAPE, 0))
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def test_sdpa_core_attention_matches_core_local_attention_in_float64(tp2):
    local_loss, local_grads = _loss_and_grads(None)
    sdpa_loss, sdpa_grads = _loss_and_grads(sdpa_attention.local_spec_with_sdpa())
    problems = []
    if sorted(local_grads) != sorted(sdpa_grads):
        problems.append(f"parameters differ: {sorted(set(local_grads) ^ set(sdpa_grads))}")
    errors = {"loss": local_rel_err(sdpa_loss.reshape(1), local_loss.reshape(1))}
    errors.update({name: local_rel_err(sdpa_grads[name], grad) for name, grad in local_grads.items()
                   if name in sdpa_grads})
    problems += [f"{name}: relative error {err:.2e}" for name, err in errors.items() if err > 1e-10]
    if all(torch.count_nonzero(local_grads[name]) == 0 for name in local_grads if "linear_qkv" in name):
        problems.append("linear_qkv got no gradient: the attention path was not exercised")
    assert_no_problems(problems, tp2)
