"""A dense stage traced with two layers instead of all of them (each later layer saves what the second does): the
estimate is the same as the whole trace's, and a model whose layers differ by their number is traced whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate import memory
from tests.support.estimate import assert_reduced_equals_whole

pytestmark = [pytest.mark.unit]


FP8_FIRST_LAST_BF16 = {"pipeline_model_parallel_size": 2, "fp8": "hybrid", "fp8_recipe": "tensorwise",
                       "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}
"""FP8 current scaling with the first and last layers in bf16: stage 0 starts on a bf16 layer, stage 1 ends on one."""


def _dense(layers: int, **fields):
    from megatron_bridge_ext.peft import LoRA
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=layers, hidden=64, ffn=256, heads=8, kv_heads=4, seq=256, micro_batch=2, vocab=128,
                         tp=2, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, LoRA(target_modules=list(shape.lora_targets), dim=8, alpha=8))
    for name, value in fields.items():
        setattr(cfg.model, name, value)
    cfg.data_parallel_size, cfg.train.global_batch_size = 1, 4
    return cfg


FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
"""Full recompute checkpointing each layer alone: each checkpoint counted as its layer's."""


@pytest.mark.parametrize("fields", [{}, {"pipeline_model_parallel_size": 2},
                                    {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
                                    FP8_FIRST_LAST_BF16, FULL, {**FULL, "pipeline_model_parallel_size": 2},
                                    {**FULL, "pipeline_model_parallel_size": 2,
                                     "virtual_pipeline_model_parallel_size": 3, "num_layers": 12,
                                     "microbatch_group_size_per_vp_stage": 2}],
                         ids=["one-stage", "pp2", "selective-recompute", "fp8-first-last-bf16-pp2", "full-recompute",
                              "full-recompute-pp2", "full-recompute-pp2-vpp3"])
def test_the_reduced_trace_of_a_dense_stage_equals_the_whole_trace(monkeypatch, fields):
    layers = fields.get("num_layers", 6)
    cfg = _dense(layers, **{name: value for name, value in fields.items() if name != "num_layers"})
    stages = cfg.model.pipeline_model_parallel_size
    for stage in range(stages):
        reduced = memory.traced_layers(cfg.model, stage)
        assert reduced.pattern == [0, 0] and reduced.sources == [0] + [1] * (layers // stages - 1)
    if fields is FP8_FIRST_LAST_BF16:  # the FP8 layers are modelled, not ignored
        assert any("FP8" in c.name for c in memory.estimate(cfg).components)
    assert_reduced_equals_whole(cfg, monkeypatch)


@pytest.mark.parametrize("fields", [{"recompute_method": "uniform", "recompute_num_layers": 2},
                                    {"recompute_method": "block", "recompute_num_layers": 1}],
                         ids=["two-layer-chunks", "block"])
def test_full_recompute_of_chunks_of_several_layers_or_of_the_first_layers_is_traced_whole(fields):
    """Checkpoints that hold a chunk of layers, or only the first layers' (``block``), differ by the layer's number."""
    cfg = _dense(6, recompute_granularity="full", **fields)
    assert memory.traced_layers(cfg.model, 0) is None


def test_each_full_recompute_checkpoint_is_counted_as_its_layers_not_the_decoders():
    """Core checkpoints each chunk's inputs from the decoder's forward; the trace counts them as the chunk's first
    layer's: every layer after the first keeps its input hidden states [s / TP, b, h] (SP and Core's
    distribute_saved_activations off) and nothing is left outside the layers in that category."""
    from megatron_bridge_ext.estimate.trace import CHECKPOINT_INPUTS

    cfg = _dense(6, **FULL)
    m = cfg.model
    est = memory.estimate(cfg)
    hidden = m.seq_length // m.tensor_model_parallel_size * cfg.train.micro_batch_size * m.hidden_size * 2
    assert m.sequence_parallel and not m.distribute_saved_activations
    assert est.activations_per_layer == {0: est.activations_per_layer[0], **{layer: hidden for layer in range(1, 6)}}
    assert est.activations_per_microbatch[CHECKPOINT_INPUTS] >= 6 * hidden


@pytest.mark.parametrize("pp", [1, 2])
def test_a_dense_stage_with_fine_grained_offloading_is_traced_reduced_and_equals_the_whole_trace(monkeypatch, pp):
    """Every layer opens the same offload groups, so a stage traced with two layers, its groups extended, keeps and
    offloads what the whole trace does: the steady state's kept groups (half of each chunk's, fraction 0.5, and the
    first backward chunk's last of each name) and the group in flight."""
    from megatron_bridge_ext.estimate.features import activation_offload

    cfg = _dense(6, pipeline_model_parallel_size=pp, fine_grained_activation_offloading=True,
                 offload_modules=["qkv_linear", "core_attn", "attn_proj"], activation_offload_fraction=0.5,
                 min_offloaded_tensor_size=0, transformer_impl="transformer_engine")
    assert memory.traced_layers(cfg.model, 0) is not None
    est = memory.estimate(cfg, attention="fused", transformer_impl="local")
    assert {activation_offload.KEPT, activation_offload.IN_FLIGHT_COPY} <= {c.name for c in est.components}
    assert_reduced_equals_whole(cfg, monkeypatch, attention="fused", transformer_impl="local")


@pytest.mark.parametrize("field, value", [("window_attn_skip_freq", 2), ("no_rope_freq", 4),
                                          ("cpu_offloading", True)])
def test_a_dense_model_whose_layers_differ_by_number_is_traced_whole(field, value):
    provider = SimpleNamespace(**{name: None for name in memory.LAYER_NUMBER_FIELDS})
    assert memory._uniform_dense(provider)
    setattr(provider, field, value)
    assert not memory._uniform_dense(provider)
