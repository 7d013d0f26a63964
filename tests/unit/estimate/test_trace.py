"""The traced microbatch's categories of module names."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate.trace import (
    ATTENTION,
    CHECKPOINT_INPUTS,
    EMBEDDING,
    LOGITS_LOSS,
    EXPERTS,
    LORA_INPUTS,
    MLP,
    MOE_DISPATCH,
    NORMS,
    category_of,
)

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("name, category", [
    ("decoder.layers.3.self_attention.linear_qkv.adapter.linear_in", LORA_INPUTS),
    ("decoder.layers.3.mlp.linear_fc2.adapter.linear_out", LORA_INPUTS),
    ("decoder.layers.3.self_attention.q_layernorm", NORMS),
    ("decoder.layers.3.input_layernorm", NORMS),
    ("decoder.final_layernorm", NORMS),
    ("decoder.layers.3.self_attention.core_attention", ATTENTION),
    ("rotary_pos_emb", ATTENTION),
    ("decoder.layers.3.mlp.linear_fc1", MLP),
    ("embedding.word_embeddings", EMBEDDING),
    ("decoder", CHECKPOINT_INPUTS),
    ("output_layer", LOGITS_LOSS),
    ("<root>", LOGITS_LOSS),
    ("per_layer_embedding", EMBEDDING),  # Gemma 4's per-layer embedding: its table, projection and norm
    ("per_layer_model_proj", EMBEDDING),
    ("per_layer_proj_norm", EMBEDDING),
    ("decoder.layers.3.per_layer_input_gate", EMBEDDING),  # and each layer's gate and projection of its slice
    ("decoder.layers.3.per_layer_projection", EMBEDDING),
    ("decoder.layers.3.post_per_layer_input_norm", NORMS),
])
def test_categories_of_module_names(name, category):
    assert category_of(name) == category


MOE = frozenset({"decoder.layers.3.mlp"})


@pytest.mark.parametrize("name, category", [
    ("decoder.layers.3.mlp", MOE_DISPATCH),  # the dispatcher's own saves (it is no module)
    ("decoder.layers.3.mlp.router", MOE_DISPATCH),
    ("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1", EXPERTS),
    ("decoder.layers.3.mlp.experts.local_experts.5", EXPERTS),
    ("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.adapter.linear_in", LORA_INPUTS),
    ("decoder.layers.3.mlp.shared_experts.linear_fc1", MLP),
    ("decoder.layers.4.mlp", MLP),  # a dense layer's MLP saves its activation itself
    ("decoder.layers.3.pre_mlp_layernorm", NORMS),
])
def test_categories_of_moe_module_names(name, category):
    assert category_of(name, MOE) == category
