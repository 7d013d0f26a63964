"""Transformer Engine's fused MoE router by its stand-ins, called where Core's MoE utilities call TE's: the bool
routing map and fp32 intermediate scores [tokens, experts] kept, as TE's functions keep them."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.unit]

TOKENS, EXPERTS, TOPK = 48, 16, 2


def _measure(call):
    from megatron_bridge_ext.estimate.features.router import kernels
    from megatron_bridge_ext.measure import SavedActivationMeter

    with kernels(), SavedActivationMeter() as meter:
        out = call()
    return out, meter.result().total_bytes


def _logits():
    import torch

    return torch.empty(TOKENS, EXPERTS, dtype=torch.bfloat16, requires_grad=True)


def test_topk_keeps_routing_map_and_fp32_scores():
    import torch
    from megatron.core.transformer.moe import moe_utils
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = _logits()
        (probs, routing_map), saved = _measure(
            lambda: moe_utils.topk_routing_with_score_function(logits, TOPK, score_function="softmax", fused=True))
        probs.sum().backward()
    assert probs.dtype == torch.bfloat16 and routing_map.dtype == torch.bool
    assert saved == TOKENS * EXPERTS * 1 + TOKENS * EXPERTS * 4
    assert tuple(logits.grad.shape) == (TOKENS, EXPERTS)


def test_aux_loss_scores_keep_fp32_scores():
    import torch
    from megatron.core.transformer.moe import moe_utils
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = _logits()
        (routing_map, scores), saved = _measure(
            lambda: moe_utils.compute_routing_scores_for_aux_loss(logits, TOPK, "softmax", fused=True))
    assert scores.dtype == torch.float32 and routing_map.dtype == torch.bool
    assert saved == TOKENS * EXPERTS * 4


def test_aux_loss_keeps_its_constants_and_the_counts():
    import torch
    from megatron.core.transformer.moe import moe_utils
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        probs = torch.empty(TOKENS, EXPERTS, dtype=torch.float32, requires_grad=True)
        counts = torch.empty(EXPERTS, dtype=torch.int64)
        loss, saved = _measure(lambda: moe_utils.switch_load_balancing_loss_func(
            probs, counts, TOKENS, TOPK, EXPERTS, 0.01, fused=True))
    assert loss.dim() == 0
    assert saved == 2 * 4 + EXPERTS * 8


def test_core_refuses_the_fusion_again_outside_the_trace():
    from megatron.core.transformer.moe import moe_utils
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = _logits()
        with pytest.raises(ValueError, match="not available"):
            moe_utils.topk_routing_with_score_function(logits, TOPK, fused=True)
