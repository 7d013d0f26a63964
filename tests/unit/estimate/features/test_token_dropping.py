"""Token dropping in the estimate: which dispatchers it is traced on, and HybridEP padded to capacity (the Nemotron 3
Super recipe's setting) sized by Core's own capacity. The tiny model: Qwen3-MoE's shape shrunk (8 experts, top-2),
TP 1, EP 4, sequence 128, micro-batch 1."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate.features import token_dropping

pytestmark = [pytest.mark.unit]


def _model(dispatcher="alltoall", backend=None, factor=1.0, padded=False, experts=8):
    return SimpleNamespace(num_moe_experts=experts, moe_token_dispatcher_type=dispatcher,
                           moe_flex_dispatcher_backend=backend, moe_expert_capacity_factor=factor,
                           moe_pad_expert_input_to_capacity=padded)


@pytest.mark.parametrize("model", [
    _model("allgather"), _model("alltoall"), _model("alltoall", padded=True),
    _model("flex", "hybridep", padded=True), _model("flex", "deepep", factor=None),
    _model("flex", "deepep", experts=None),
])
def test_token_dropping_is_traced_on_core_dispatchers_and_on_padded_hybridep(model):
    assert token_dropping.findings(model) == []


@pytest.mark.parametrize("model", [_model("flex", "deepep"), _model("flex", "hybridep"),
                                   _model("flex", "deepep", padded=True)])
def test_token_dropping_where_the_kernels_count_the_capped_tokens_is_refused(model):
    [finding] = token_dropping.findings(model)
    assert finding.setting == "model.moe_expert_capacity_factor" and "not modelled" in finding.message
    assert "moe_pad_expert_input_to_capacity=true" in finding.fix


def test_the_assumption_names_the_capacity_and_whether_it_pads():
    assert token_dropping.assumption(_model(factor=None)) is None
    assert "capped at the capacity" in token_dropping.assumption(_model(factor=0.5))
    line = token_dropping.assumption(_model(factor=1.1, padded=True))
    assert "padded to exactly the capacity" in line and "x 1.1)" in line


def test_hybridep_padded_to_capacity_dispatches_the_capacity_of_every_rank():
    """Core's HybridEP manager sizes the dispatch by the capacity when it pads (token_dispatcher.py L1105-1119):
    each local expert receives ceil(tokens x top-k / experts x factor) rows from each of the EP ranks, whatever the
    stated load; the experts' saves scale with those rows against the dropless dispatch."""
    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.estimate.trace import EXPERTS
    from tests.unit.estimate.test_estimate_moe import EXPERTS_N, SEQ, TOPK, _tiny

    ep, factor = 4, 1.5
    hybrid = ("model.moe_flex_dispatcher_backend=hybridep",)
    padded = hybrid + (f"model.moe_expert_capacity_factor={factor}", "model.moe_pad_expert_input_to_capacity=true")
    dropless, capped = (memory.estimate(_tiny(tp=1, ep=ep, dp=4, layers=2, peft="none", dispatcher="flex",
                                              extra=extra)) for extra in (hybrid, padded))
    share = math.ceil(SEQ * TOPK / EXPERTS_N)
    capacity = math.ceil(SEQ * TOPK / EXPERTS_N * factor)
    local = EXPERTS_N // ep
    assert dropless.settings.moe.routed_tokens_per_layer == share * ep * local
    assert capped.settings.moe.routed_tokens_per_layer == capacity * ep * local
    assert capped.activations_per_microbatch[EXPERTS] * share == dropless.activations_per_microbatch[EXPERTS] * capacity
