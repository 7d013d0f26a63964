"""Configs to estimate: a config.json's shape fields below one are refused before the model is built."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate import configs
from megatron_bridge_ext.findings import Refused
from tests.support.estimate import QWEN3_8B

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def qwen_tp2():
    return configs.from_hf_config(QWEN3_8B, configs.Layout(tp=2, seq=1024))


@pytest.mark.parametrize("field", list(configs.SHAPE_FIELDS))
@pytest.mark.parametrize("value", [0, -8])
def test_a_shape_field_below_one_is_refused_before_the_model_is_built(qwen_tp2, field, value):
    """However the value came (a recipe's default, an override), the estimate refuses it by name before
    Megatron Core divides by it."""
    import copy

    from megatron_bridge_ext.estimate import estimate

    cfg = copy.deepcopy(qwen_tp2)
    setattr(cfg.model, field, value)
    with pytest.raises(Refused) as refused:
        estimate(cfg)
    assert refused.value.one_line() == f"model.{field}: is {value}. Fix: set it to a whole number of 1 or more"


NEMOTRONH_4B = "megatron.bridge.recipes.nemotronh.h100.nemotronh:nemotronh_4b_pretrain_1gpu_h100_bf16_config"
NANO_PRETRAIN = "megatron.bridge.recipes.nemotronh.h100.nemotron_3_nano:nemotron_3_nano_pretrain_8gpu_h100_bf16_config"


def test_a_null_tokenizers_vocabulary_is_the_models_as_bridges_setup_sets_it():
    """The recipe leaves model.vocab_size unset and states NullTokenizer(vocab_size=...): Bridge's setup takes the
    tokenizer's size and pads it (training/setup.py _validate_and_set_vocab_size)."""
    import importlib

    module, _, function = NEMOTRONH_4B.partition(":")
    stated = getattr(importlib.import_module(module), function)().tokenizer
    assert stated.tokenizer_type == "NullTokenizer" and stated.vocab_size
    built = configs.build(configs.Layout(), recipe=NEMOTRONH_4B)
    assert (built.cfg.model.vocab_size, built.cfg.model.should_pad_vocab) == (stated.vocab_size, True)
    assert any(n.startswith(f"vocabulary {stated.vocab_size}: the recipe's NullTokenizer") for n in built.notes)


def test_a_hugging_face_tokenizers_vocabulary_is_read_from_the_config_json_given():
    import json

    from tests.support.estimate import DATA

    path = f"{DATA}/nemotron-3-nano-30b-a3b/config.json"
    built = configs.build(configs.Layout(), recipe=NANO_PRETRAIN, hf_config=path)
    assert built.cfg.model.vocab_size == json.load(open(path))["vocab_size"] and built.cfg.model.should_pad_vocab
    assert any("tokenizer is nvidia/" in n and f"{path}'s vocab_size" in n for n in built.notes)
    # without the file the vocabulary stays unset, and the plan's check of the built config says so
    from types import SimpleNamespace

    from megatron_bridge_ext.plan_config import built_problem

    unset = configs.build(configs.Layout(), recipe=NANO_PRETRAIN).cfg
    assert unset.model.vocab_size is None
    assert built_problem(unset, SimpleNamespace(etp=None, moe_imbalance=None)).setting == "model.vocab_size"


def test_a_model_type_transformers_does_not_know_is_read_as_its_fields(tmp_path):
    data = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128, "kv_lora_rank": 16}
    config = configs.hf_config_object(data)
    assert (config.model_type, config.kv_lora_rank, config.architectures) == ("kimi_k2", 16, data["architectures"])
    assert "model_type 'kimi_k2' is not one transformers" in configs.unknown_model_type(data)
    assert configs.unknown_model_type({"model_type": "qwen3"}) is None


@pytest.mark.parametrize("extra", [
    # Kimi K2's YaRN RoPE: the base class would standardise it before max_position_embeddings is set
    {"max_position_embeddings": 131072, "rope_scaling": {"type": "yarn", "factor": 32.0,
                                                         "original_max_position_embeddings": 4096}},
    # Step-3.5's per-layer list holds its 3 MTP layers too: the base class would refuse 2 + 1 entries for 2 layers
    {"layer_types": ["full_attention", "sliding_attention", "full_attention"], "num_nextn_predict_layers": 1},
], ids=["rope-before-positions", "layer-types-with-mtp"])
def test_an_unknown_model_types_fields_are_kept_as_the_file_states_them(extra):
    data = {"model_type": "a_type_nobody_registered", "architectures": ["Step3p5ForCausalLM"], "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128, **extra}
    config = configs.hf_config_object(data)
    assert {name: getattr(config, name) for name in extra} == extra


QWEN3_NEXT_PEFT = "megatron.bridge.recipes.qwen.h100.qwen3_next:qwen3_next_80b_a3b_peft_1gpu_h100_bf16_config"


def test_a_recipe_that_refuses_itself_is_refused_citing_its_line_and_no_hub():
    """Bridge ships Qwen3-Next's PEFT recipe raising NotImplementedError before it builds anything: the finding cites
    the recipe file's line that raises (read from the recipe's own traceback) and does not send the user to the hub,
    which would not change it."""
    import importlib

    from tests.support.cited import cites, raised_at

    module, _, function = QWEN3_NEXT_PEFT.partition(":")
    file, line = raised_at(getattr(importlib.import_module(module), function), NotImplementedError)
    with pytest.raises(Refused) as refused:
        configs.build(configs.Layout(), recipe=QWEN3_NEXT_PEFT)
    [finding] = refused.value.findings
    assert cites(finding.message, f"recipes/qwen/h100/{file}", line), finding.message
    assert "NotImplementedError: PEFT is not currently supported" in finding.message
    assert "hub" not in finding.fix and "--hf-config" not in finding.fix
