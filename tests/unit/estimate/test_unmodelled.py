"""What the estimate leaves out, named: a hybrid model's Mamba layers, CUDA graph memory pools."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate import unmodelled

pytestmark = [pytest.mark.unit]


def _model(**fields):
    base = {"cuda_graph_impl": "none", "enable_cuda_graph": False, "external_cuda_graph": False,
            "use_te_rng_tracker": False}
    return SimpleNamespace(**{**base, **fields})


def test_a_hybrid_pattern_names_its_mamba_layers_and_leaves_out_pipe_marks_and_mtp():
    """``M*|-ME/*E``: the main decoder is M, *, -, M, E (five layers); ``/`` starts the MTP layers."""
    finding = unmodelled.hybrid_finding(_model(hybrid_layer_pattern="M*|-ME/*E"))
    assert finding.setting == "model.hybrid_layer_pattern"
    assert "2 Mamba layers (of 5; 1 attention, 1 MLP, 1 MoE) are not modelled by our estimate" in finding.message
    assert "mamba_ssm and causal_conv1d" in finding.message
    assert finding.fix


def test_the_deprecated_override_pattern_is_read_too():
    finding = unmodelled.hybrid_finding(_model(hybrid_override_pattern="MMM-"))
    assert "3 Mamba layers (of 4; 1 MLP)" in finding.message


@pytest.mark.parametrize("fields", [{}, {"hybrid_layer_pattern": None}, {"hybrid_layer_pattern": "*-*E"}])
def test_no_mamba_layers_no_refusal(fields):
    assert unmodelled.hybrid_finding(_model(**fields)) is None


def test_bridges_caveat_counts_the_layers_it_reads_as_transformer_layers():
    caveat = unmodelled.bridge_caveat(_model(hybrid_layer_pattern="MEM*E", num_moe_experts=8))
    assert caveat == ("Bridge's formula reads no hybrid pattern: it counts all 5 layers as attention + MoE layers, "
                      "where this model has 2 Mamba, 1 attention, 2 MoE")
    assert unmodelled.bridge_caveat(_model()) is None


class _Module(Enum):
    attn = 1
    mamba = 6


@pytest.mark.parametrize("fields, setting", [
    ({}, None),
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": [_Module.attn, _Module.mamba]},
     "model.cuda_graph_impl='transformer_engine', modules ['attn', 'mamba']"),
    ({"cuda_graph_impl": "local", "cuda_graph_modules": "full"}, "model.cuda_graph_impl='local', modules ['full']"),
    ({"enable_cuda_graph": True}, "model.enable_cuda_graph=True (cuda_graph_impl 'local')"),
    ({"external_cuda_graph": True}, "model.external_cuda_graph=True (cuda_graph_impl 'transformer_engine')"),
])
def test_every_field_that_turns_cuda_graphs_on_is_named(fields, setting):
    model = _model(**fields)
    assert unmodelled.cuda_graph_setting(model) == setting
    lines = unmodelled.config_lines(SimpleNamespace(model=model, mixed_precision=None))
    if setting is None:
        assert lines == []
    else:
        assert lines == [unmodelled.cuda_graph_line(model)]
        assert lines[0].startswith(f"CUDA graph memory pools ({setting}) are not modelled")


def test_cuda_graphs_without_te_rng_tracker_are_refused_as_bridge_refuses_them():
    finding = unmodelled.cuda_graph_problem(_model(cuda_graph_impl="local"))
    assert finding.setting == "model.use_te_rng_tracker" and "use_te_rng_tracker=True" in finding.fix
    assert unmodelled.cuda_graph_problem(_model(cuda_graph_impl="local", use_te_rng_tracker=True)) is None
    assert unmodelled.cuda_graph_problem(_model()) is None


def test_the_traced_copy_runs_without_cuda_graphs_and_says_so():
    model = _model(enable_cuda_graph=True, use_te_rng_tracker=True)
    [note] = unmodelled.drop_cuda_graphs(model)
    assert "traced eagerly" in note and "memory pools are not modelled" in note
    assert unmodelled.cuda_graph_setting(model) is None
    assert unmodelled.drop_cuda_graphs(model) == []
