"""The tiny model's mixture-of-experts options: which layers are MoE, and what reaches Core's config."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.testing import tiny_model

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("freq, layers, moe", [(1, 2, [0, 1]), ([0, 1], 2, [1]), (2, 4, [0, 2]), ([1, 0, 1], 3, [0, 2])])
def test_moe_layers_read_moe_layer_freq_as_core_does(freq, layers, moe):
    """An int N makes every N-th layer MoE starting at layer 0, a list marks each layer (Core's
    get_gpt_decoder_layer_specs); only a pattern with dense layers reaches Core's config."""
    shape = tiny_model.TinyGPTShape(experts=4, layers=layers, moe_layer_freq=freq)
    assert tiny_model.moe_layers(shape) == moe
    config = tiny_model.transformer_config(shape)
    assert config.moe_layer_freq == (freq if len(moe) < layers else 1)


def test_shared_experts_reach_core_s_config_only_with_a_width():
    plain = tiny_model.transformer_config(tiny_model.TinyGPTShape(experts=4, dispatcher="alltoall"))
    assert (plain.moe_shared_expert_intermediate_size, plain.moe_shared_expert_overlap) == (None, False)
    shared = tiny_model.transformer_config(tiny_model.TinyGPTShape(experts=4, dispatcher="alltoall", shared_ffn=32,
                                                                   shared_overlap=True))
    assert (shared.moe_shared_expert_intermediate_size, shared.moe_shared_expert_overlap) == (32, True)


def test_a_moe_layer_pattern_of_the_wrong_length_is_a_shape_problem():
    problems = tiny_model.shape_problems(tiny_model.TinyGPTShape(experts=4, layers=3, moe_layer_freq=[0, 1]))
    assert problems == ["moe_layer_freq=[0, 1] does not mark each of the 3 layers (1 MoE, 0 dense)"]
