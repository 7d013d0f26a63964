"""Transformer Engine's parallel cross entropy by its stand-in: the logits' storage kept (the gradient written over
it), called where Core's language model calls TE's."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.unit]

S, B, VOCAB = 32, 2, 100


def _loss_through_core(logits, labels):
    """Core's ``compute_language_model_loss`` with the TE fusion asked for, under the stand-in."""
    from types import SimpleNamespace

    from megatron.core.models.common.language_module.language_module import LanguageModule

    from megatron_bridge_ext.estimate.features.cross_entropy import kernels
    from megatron_bridge_ext.measure import SavedActivationMeter

    owner = SimpleNamespace(config=SimpleNamespace(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te",
                                                   cuda_graph_impl="none"),
                            pg_collection=SimpleNamespace(tp=None))
    with kernels(), SavedActivationMeter() as meter:
        loss = LanguageModule.compute_language_model_loss(owner, labels, logits)
    return loss, meter.result().total_bytes


def test_keeps_the_logits_storage_in_their_dtype():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(S, B, VOCAB, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(B, S, dtype=torch.long)
        loss, saved = _loss_through_core(logits, labels)
        loss.sum().backward()
    assert tuple(loss.shape) == (B, S) and loss.dtype == torch.float32
    assert saved == S * B * VOCAB * 2
    assert tuple(logits.grad.shape) == (S, B, VOCAB)


def test_copies_logits_not_contiguous_in_their_last_two_dimensions():
    """TE's wrapper copies such a shard first (triton/cross_entropy.py L52-53): the copy is what it keeps, and the
    wider storage the view came from is not."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        wide = torch.empty(S, B, 2 * VOCAB, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(B, S, dtype=torch.long)
        _, saved = _loss_through_core(wide[..., :VOCAB], labels)
    assert saved == S * B * VOCAB * 2


def test_used_only_with_the_te_fusion():
    from types import SimpleNamespace

    from megatron_bridge_ext.estimate.features.cross_entropy import used

    assert used(SimpleNamespace(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te"))
    assert not used(SimpleNamespace(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native"))
    assert not used(SimpleNamespace(cross_entropy_loss_fusion=False, cross_entropy_fusion_impl="te"))
