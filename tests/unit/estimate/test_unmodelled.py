"""What the estimate leaves out, named: a hybrid model's untraced layer kinds, the mixer's unfused path, virtual
pipelines; CUDA graph memory pools."""

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


def test_a_hybrid_model_of_traced_layer_kinds_is_not_refused():
    """Mamba, attention, MLP and MoE layers are built and traced (the Mamba kernels by stand-in)."""
    assert unmodelled.hybrid_findings(_model(hybrid_layer_pattern="M*|-ME/*E", pipeline_model_parallel_size=1)) == []


def test_other_layer_kinds_are_named_with_their_counts_pipe_marks_and_mtp_left_out():
    """``MG*|GD/*E``: the main decoder is M, G, *, G, D (five layers); ``/`` starts the MTP layers."""
    [finding] = unmodelled.hybrid_findings(_model(hybrid_layer_pattern="MG*|GD/*E"))
    assert finding.setting == "model.hybrid_layer_pattern"
    assert finding.message.startswith("the hybrid model's 2 gated delta net, 1 DeepSeek sparse attention layer(s) "
                                      "(of 5) are not modelled by our estimate")
    assert finding.fix


def test_the_deprecated_override_pattern_is_read_too():
    [finding] = unmodelled.hybrid_findings(_model(hybrid_override_pattern="M+M-"))
    assert "1 multi-latent attention layer(s) (of 4)" in finding.message


@pytest.mark.parametrize("fields, setting", [
    ({"virtual_pipeline_model_parallel_size": 2}, "model.virtual_pipeline_model_parallel_size"),
])
def test_virtual_pipelines_of_a_mamba_hybrid_are_named(fields, setting):
    [finding] = unmodelled.hybrid_findings(_model(hybrid_layer_pattern="M*M-", **fields))
    assert finding.setting == setting and finding.fix


@pytest.mark.parametrize("pattern", ["*-*E", "M*M-"])
def test_low_precision_is_left_to_the_precision_model_mamba_layers_or_not(pattern):
    """FP8 on Mamba layers is TE's contract on in_proj and out_proj (estimate.te_fp8); FP4 is refused for every model
    by the estimate's own check (memory._unsupported)."""
    assert unmodelled.hybrid_findings(_model(hybrid_layer_pattern=pattern, fp8="hybrid")) == []
    assert unmodelled.hybrid_findings(_model(hybrid_layer_pattern=pattern, fp4="nvfp4")) == []


def test_the_unfused_mamba_path_is_traced_not_refused():
    assert unmodelled.hybrid_findings(_model(hybrid_layer_pattern="M*M-", use_mamba_mem_eff_path=False)) == []


@pytest.mark.parametrize("fields", [{}, {"hybrid_layer_pattern": None}, {"virtual_pipeline_model_parallel_size": 4}])
def test_a_model_without_a_pattern_is_no_hybrid(fields):
    assert unmodelled.hybrid_findings(_model(**fields)) == []


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
        assert lines[0].startswith(f"CUDA graph memory pools ({setting}) are partly modelled")


def test_cuda_graphs_without_te_rng_tracker_are_refused_as_bridge_refuses_them():
    finding = unmodelled.cuda_graph_problem(_model(cuda_graph_impl="local"))
    assert finding.setting == "model.use_te_rng_tracker" and "use_te_rng_tracker=True" in finding.fix
    assert unmodelled.cuda_graph_problem(_model(cuda_graph_impl="local", use_te_rng_tracker=True)) is None
    assert unmodelled.cuda_graph_problem(_model()) is None


def test_the_traced_copy_runs_without_cuda_graphs_and_says_so():
    model = _model(enable_cuda_graph=True, use_te_rng_tracker=True)
    [note] = unmodelled.drop_cuda_graphs(model)
    assert "traced eagerly" in note and "static buffers are the capture phase's" in note
    assert unmodelled.cuda_graph_setting(model) is None
    assert unmodelled.drop_cuda_graphs(model) == []
