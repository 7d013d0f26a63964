"""``moe_act`` recompute in the estimate: the routed experts keep what Core's TEGroupedMLP keeps under it (fc1's input
and output and the routing probability per token; nothing of the activation and fc2's input released), from the
shapes. The tiny MoE model: 2 layers of 2 experts, top-2 (every token to every expert: a balanced load), h 64,
expert FFN 64, TP 1, bf16 (2 B; the probabilities in bf16 too)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate.features import moe_act
from megatron_bridge_ext.estimate.trace import EXPERTS

pytestmark = [pytest.mark.unit]

E, LAYERS = 2, 2
MOE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"])


def _experts(swiglu: bool, **recompute):
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(tp=1, sequence_parallel=False, experts=2, topk=2, swiglu=swiglu, dtype="bfloat16")
    est = estimate(tiny_config(shape, moe_grouped_gemm=True, **recompute), attention="local",
                   transformer_impl="local", device="cpu")
    return shape, est.settings.moe.routed_tokens_per_layer, est.activations_per_microbatch[EXPERTS]


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_the_experts_keep_fc1s_input_and_output_and_the_probabilities(swiglu):
    shape, routed, kept = _experts(swiglu, **MOE_ACT)
    fc1_out = (2 if swiglu else 1) * shape.moe_ffn
    assert kept == LAYERS * routed * ((shape.hidden + fc1_out) * E + E)


@pytest.mark.parametrize("swiglu, activation_saves", [(False, 1), (True, 3)], ids=["gelu", "swiglu"])
def test_the_saving_is_the_activations_own_saves_and_fc2s_input(swiglu, activation_saves):
    """Core's unfused activation (mlp.py L319-337) keeps, beyond fc1's output and the probabilities: GeLU's output for
    the probability's multiply; SwiGLU's SiLU output, the linear half plus its offset and their product (for the
    multiply with the SiLU and the probability), each [routed, ffn]; fc2 keeps its input [routed, ffn]."""
    shape, routed, without = _experts(swiglu)
    _, _, kept = _experts(swiglu, **MOE_ACT)
    assert without - kept == LAYERS * routed * shape.moe_ffn * E * (activation_saves + 1)


def test_moe_act_under_fp8_is_refused_by_name():
    model = SimpleNamespace(num_moe_experts=4, recompute_granularity="selective", recompute_modules=["moe_act"],
                            fp8="hybrid")
    assert [f.setting for f in moe_act.findings(model)] == ["model.recompute_modules"]
    model.fp8 = None
    assert moe_act.findings(model) == []
    full = SimpleNamespace(num_moe_experts=4, recompute_granularity="full", recompute_modules=["moe_act"])
    assert not moe_act.used(full)
