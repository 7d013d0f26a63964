"""A recipe's own attention in the estimate: Gemma 3's self-attention kept in the traced spec with each layer's window
(from the model's config.json), the attention a Gemma run uses read from the spec it is built with."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

pytestmark = [pytest.mark.unit]

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data")
GEMMA3 = os.path.join(DATA, "gemma-3-1b-pt", "config.json")


@pytest.fixture(scope="module")
def bridge():
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()


def _gemma3_layers(attention: str):
    """Each layer of Gemma 3 1B (built from its config.json as ``mbx plan --hf-config`` builds it) on fake tensors,
    as the estimate builds the rank for ``attention``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from megatron_bridge_ext.estimate import configs, memory
    from megatron_bridge_ext.estimate.build import build_rank_model
    from megatron_bridge_ext.estimate.fake import fake_parallel_world

    cfg = configs.from_hf_config(GEMMA3, configs.Layout(tp=1, seq=1024))
    prepared = memory.prepare(cfg, data_parallel_size=1, num_microbatches=1)
    with fake_parallel_world(tp=1, pp=1, cp=1, rank=0, device="cpu"):
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        model = build_rank_model(copy.deepcopy(prepared.provider), None, attention=attention, mode=mode,
                                 device="cpu", dtype=torch.bfloat16, transformer_impl="local")
    return list(model.decoder.layers)


def test_gemma3_local_attention_keeps_its_self_attention_and_each_layers_window(bridge):
    """Hugging Face's Gemma 3: a layer is global where its number (from 1) is a multiple of
    ``sliding_window_pattern``, else it attends to ``sliding_window`` keys, the query's own among them: a left
    window of ``sliding_window - 1`` and none to the right."""
    hf = json.load(open(GEMMA3))
    layers = _gemma3_layers("local")
    assert len(layers) == hf["num_hidden_layers"]
    expected = [None if number % hf["sliding_window_pattern"] == 0 else (hf["sliding_window"] - 1, 0)
                for number in range(1, hf["num_hidden_layers"] + 1)]
    assert [layer.self_attention.core_attention.config.window_size for layer in layers] == expected
    assert {type(layer.self_attention).__name__ for layer in layers} == {"Gemma3SelfAttention"}


def test_gemma3_fused_attention_keeps_its_self_attention_around_the_stand_in(bridge):
    from megatron_bridge_ext.estimate.standins import FusedAttentionStandIn

    layers = _gemma3_layers("fused")
    assert {type(layer.self_attention).__name__ for layer in layers} == {"Gemma3SelfAttention"}
    assert all(isinstance(layer.self_attention.core_attention, FusedAttentionStandIn) for layer in layers)


def _kind(provider):
    from megatron_bridge_ext.levers.recompute.attention import attention_kind_from_config

    return attention_kind_from_config(provider)


def test_gemma3_runs_transformer_engines_attention(bridge):
    """Bridge's Gemma 3 spec puts ``Gemma3TEDotProductAttention``, a subclass of TE's, in its core attention (with the
    flash backend): a run uses fused attention, though TE is a stub here."""
    from megatron.bridge.models.gemma.gemma3_provider import Gemma3ModelProvider

    from megatron_bridge_ext.levers.recompute import attention

    found = _kind(Gemma3ModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128))
    assert found.kind == attention.FUSED
    assert "Gemma3TEDotProductAttention" in found.implementation


def test_gemma4_dense_runs_its_own_local_spec(bridge):
    """Gemma 4's dense provider builds ``get_gemma4_layer_spec`` (Core's unfused attention) whatever its
    ``transformer_layer_spec`` (Bridge's TE default): the run's attention is unfused and the fused stand-in refused."""
    from megatron.bridge.models.gemma.gemma4_provider import Gemma4DenseProvider

    from megatron_bridge_ext.estimate.features import recipe_attention
    from megatron_bridge_ext.levers.recompute import attention

    provider = Gemma4DenseProvider()
    assert getattr(provider.transformer_layer_spec, "__name__", "") == "default_layer_spec"
    assert _kind(provider).kind == attention.UNFUSED
    assert recipe_attention.trace_findings(provider, attention="local", fused="fused") == []
    (finding,) = recipe_attention.trace_findings(provider, attention="fused", fused="fused")
    assert finding.setting == "attention" and "Gemma4DenseProvider" in finding.message


def _dataset(packing: bool):
    from types import SimpleNamespace

    return SimpleNamespace(dataset=SimpleNamespace(enable_offline_packing=packing,
                                                   offline_packing_specs=SimpleNamespace(packed_sequence_size=2048)))


@pytest.mark.parametrize("packing", [True, False])
def test_gemma2_on_packed_sequences_is_refused(bridge, packing):
    """Gemma 2's core attention raises on the packed-sequence metadata Bridge hands the model from an offline-packed
    dataset (its SFT and PEFT recipes' SQuAD); Gemma 3's TE attention takes it."""
    from megatron.bridge.models.gemma.gemma2_provider import Gemma2ModelProvider
    from megatron.bridge.models.gemma.gemma3_provider import Gemma3ModelProvider

    from megatron_bridge_ext.estimate.features import recipe_attention

    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
    found = recipe_attention.packed_findings(Gemma2ModelProvider(**shape), _dataset(packing))
    assert [f.setting for f in found] == (["dataset.enable_offline_packing"] if packing else [])
    assert recipe_attention.packed_findings(Gemma3ModelProvider(**shape), _dataset(packing)) == []
