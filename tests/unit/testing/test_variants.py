"""The variant registry: every variant applied through MemoryConfig ends with the model config and PEFT its flags
declare, which are the ones the demo and benchmarks set by hand before (Core's recompute fields, our class with its
strategy or Bridge's own); and the variants each PEFT kind gets by default."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_bridge_ext.findings import Refused
from megatron_bridge_ext.peft import kinds
from megatron_bridge_ext.testing import tiny_model, variants

pytestmark = [pytest.mark.unit]

CASES = [(kind, name) for kind in kinds.KINDS for name, v in variants.VARIANTS.items() if v.available(kind)[0]]


def _shape(kind: str) -> tiny_model.TinyGPTShape:
    return tiny_model.TinyGPTShape(peft=kind, swiglu=kind == "canonical_lora")


def _declared_config(variant: variants.Variant) -> dict:
    """The Core fields the flags ask for, as the demo set them itself: selective recompute of the modules."""
    if variant.recompute_modules is None:
        return {}
    return {"recompute_granularity": "selective", "recompute_modules": list(variant.recompute_modules)}


def _declared_peft(variant: variants.Variant, shape: tiny_model.TinyGPTShape):
    """The PEFT the flags ask for, built directly: ours with the strategy, else Bridge's (with its regather flag)."""
    fields = tiny_model.peft_fields(shape)
    if variant.sequence_parallel_input_strategy is not None:
        return kinds.our_class(shape.peft)(**fields, sequence_parallel_input_strategy=variant.sequence_parallel_input_strategy)
    extra = {"sequence_parallel_input_regather": True} if variant.upstream_regather else {}
    return kinds.bridge_class(shape.peft)(**fields, **extra)


def _plain_fields(obj) -> dict:
    """A dataclass's field values that compare by value (functions and modules Core builds per instance left out)."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if hasattr(obj, f.name)}
    return {k: v for k, v in values.items() if v is None or isinstance(v, (bool, int, float, str, list, tuple, dict))}


@pytest.mark.parametrize("kind, name", CASES)
def test_each_variant_ends_with_the_config_and_peft_its_flags_declare(kind, name):
    variant, shape = variants.VARIANTS[name], _shape(kind)
    applied = variant.apply(shape)
    got = tiny_model.transformer_config(shape, **applied.config)
    want = tiny_model.transformer_config(shape, **_declared_config(variant))
    assert _plain_fields(got) == _plain_fields(want)
    expected_peft = _declared_peft(variant, shape)
    assert type(applied.peft) is type(expected_peft)
    assert _plain_fields(applied.peft) == _plain_fields(expected_peft)


def test_the_flags_change_what_they_name():
    """Guard for the comparison above: the recompute and strategy variants differ from the baseline."""
    shape = _shape("lora")
    base = variants.VARIANTS["baseline"].apply(shape)
    both = variants.VARIANTS["shard_local+core_attn"].apply(shape)
    assert tiny_model.transformer_config(shape, **base.config).recompute_granularity is None
    assert tiny_model.transformer_config(shape, **both.config).recompute_granularity == "selective"
    assert type(base.peft) is kinds.bridge_class("lora") and type(both.peft) is kinds.our_class("lora")


def test_a_variant_is_checked_as_memory_config_checks_a_recipe():
    """Selective modules over a model with full recompute would replace it: MemoryConfig refuses, and so does the
    variant (the fields the demo used to set by hand never looked at the recompute settings already there)."""
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    with pytest.raises(Refused, match="recompute_modules"):
        variants.VARIANTS["core_attn"].apply(_shape("lora"), **full)


def test_default_variants_per_kind():
    assert "upstream_regather" not in [v.name for v in variants.select(None, "canonical_lora")]
    assert {"baseline", "regather", "shard_local"} <= {v.name for v in variants.select(None, "dora")}


def test_a_dense_shape_sets_no_moe_field_and_an_moe_shape_sets_core_s():
    """The MoE option leaves the dense config as it was; with experts, Core's MoE fields carry the shape's layout."""
    dense = tiny_model.transformer_config(tiny_model.TinyGPTShape())
    assert (dense.num_moe_experts, dense.expert_model_parallel_size) == (None, 1)
    moe = tiny_model.transformer_config(tiny_model.TinyGPTShape(experts=4, topk=2, moe_ffn=48, ep=2, etp=1))
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size, moe.moe_token_dispatcher_type,
            moe.expert_model_parallel_size, moe.expert_tensor_parallel_size) == (4, 2, 48, "allgather", 2, 1)

