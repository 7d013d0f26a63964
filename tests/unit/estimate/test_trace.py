"""The traced microbatch's categories of module names."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate.trace import (
    ATTENTION,
    CHECKPOINT_INPUTS,
    EMBEDDING,
    LOGITS_LOSS,
    LORA_INPUTS,
    MLP,
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
])
def test_categories_of_module_names(name, category):
    assert category_of(name) == category
