"""Latent MoE in the estimate: Core's MoE layer traced with its latent projections (Transformer Engine's duplicated
TELinear by the stand-in), the dispatcher and the routed experts at the latent width, from the shapes.

The model: Nemotron 3 Nano's config shrunk (tests/unit/estimate/test_estimate_hybrid.py), pattern MEM*E (two MoE
layers), h 64, 4 experts of FFN 32, top-2, a shared expert, TP 2 with SP, EP 2, sequence 128, micro-batch 1, bf16."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate.features import latent_moe
from megatron_bridge_ext.estimate.trace import EXPERTS

pytestmark = [pytest.mark.unit]

LATENT, E, MOE_LAYERS = 16, 2, 2
NO_OVERLAP = "model.moe_shared_expert_overlap=False"  # Core refuses it with latent projections in training


def _estimate(latent=None):
    from megatron_bridge_ext.estimate import memory
    from tests.unit.estimate.test_estimate_hybrid import _tiny

    extra = (NO_OVERLAP,) + ((f"model.moe_latent_size={latent}",) if latent else ())
    cfg = _tiny(pattern="MEM*E", extra=extra)
    return cfg, memory.estimate(cfg)


@pytest.fixture(scope="module")
def pair():
    return _estimate(), _estimate(LATENT)


def test_the_experts_take_latent_tokens_and_the_up_projection_keeps_its_latent_input(pair):
    """Each MoE layer: the routed experts' fc1 keeps [routed, latent] where it kept [routed, h]; fc2_latent_proj keeps
    its input, the combined latent output [T, latent] of the rank's tokens (T = s/t x b); fc1_latent_proj's input is
    the pre-MLP norm's output, which the router keeps already."""
    (cfg, plain), (_, latent) = pair
    h, routed = cfg.model.hidden_size, latent.settings.moe.routed_tokens_per_layer
    tokens = cfg.model.seq_length // 2 * latent.settings.micro_batch
    per_layer = -routed * (h - LATENT) * E + tokens * LATENT * E
    assert routed == plain.settings.moe.routed_tokens_per_layer
    expected = plain.activations_per_microbatch[EXPERTS] + MOE_LAYERS * per_layer
    assert latent.activations_per_microbatch[EXPERTS] == expected


def _weights(est, name):
    return next(c.bytes for c in est.components if c.name == f"weights: {name}")


def test_each_moe_layer_holds_both_projections_whole_and_latent_experts(pair):
    """Duplicated mode: h x latent twice per MoE layer on every TP rank; each local expert's fc1 [ffn, latent]
    and fc2 [latent, ffn] in place of h (squared ReLU, no gated unit: the experts scale with the width)."""
    (cfg, plain), (_, latent) = pair
    h = cfg.model.hidden_size
    projections = MOE_LAYERS * 2 * h * LATENT * E
    assert _weights(latent, "transformer layers") - _weights(plain, "transformer layers") == projections
    assert _weights(latent, "experts") * h == _weights(plain, "experts") * LATENT
    assert any("latent MoE" in line for line in latent.assumptions)
    assert not any("latent MoE" in line for line in plain.assumptions)


def test_biases_on_the_projections_are_refused_by_name():
    model = SimpleNamespace(num_moe_experts=8, moe_latent_size=16, add_bias_linear=True)
    assert [f.setting for f in latent_moe.findings(model)] == ["model.add_bias_linear"]
    assert latent_moe.findings(SimpleNamespace(num_moe_experts=8, moe_latent_size=16, add_bias_linear=False)) == []
    assert latent_moe.findings(SimpleNamespace(num_moe_experts=None, moe_latent_size=16, add_bias_linear=True)) == []


def test_shared_experts_overlapped_with_latent_projections_are_refused_as_core_refuses_them():
    """Core raises in the first forward (moe_layer.py L469-475); the estimate refuses the config before building."""
    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.findings import Refused
    from tests.unit.estimate.test_estimate_hybrid import _tiny

    cfg = _tiny(pattern="MEM*E", extra=(f"model.moe_latent_size={LATENT}", "model.moe_shared_expert_overlap=True"))
    with pytest.raises(Refused) as refused:
        memory.estimate(cfg)
    assert not isinstance(refused.value, memory.NotModelled)
    assert [f.setting for f in refused.value.findings] == ["model.moe_shared_expert_overlap"]
