"""Our DoRA and CanonicalLoRA by kind, as configuration objects, and the kinds registry, in one process (no ranks).

* drop-in: every field of Bridge's class with Bridge's default, plus ``sequence_parallel_input_strategy``;
* the strategy field: validation at construction and on assignment, naming the class;
* Bridge's config machinery: ``_target_`` instantiation and Hydra-style overrides (the latter need hydra-core);
* :mod:`megatron_bridge_ext.peft.kinds`.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_bridge_ext.peft import kinds
from tests.support.peft import FIELD, NEW_KINDS

pytestmark = [pytest.mark.unit]


def _init_fields(obj_or_cls) -> dict:
    obj = obj_or_cls() if isinstance(obj_or_cls, type) else obj_or_cls
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


# ------------------------------------------------------------------------------------------ drop-in


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_every_bridge_field_is_accepted_with_bridges_default(classes, kind):
    bridge, ours = classes[kind]
    assert issubclass(ours, bridge) and ours.__name__ == bridge.__name__
    want, got = _init_fields(bridge), _init_fields(ours)
    assert {name: got[name] for name in want} == want
    assert set(got) - set(want) == {FIELD} and got[FIELD] is None
    assert ours().strategy_in_effect == "off" and ours().report() == []


def test_bridge_fields_pass_through(classes):
    dora = classes["dora"][1](target_modules=["linear_qkv"], dim=4, alpha=8, dropout=0.1, lora_A_init_method="kaiming")
    assert (dora.target_modules, dora.dim, dora.alpha, dora.dropout, dora.lora_A_init_method) == (
        ["linear_qkv"], 4, 8, 0.1, "kaiming")
    canonical = classes["canonical_lora"][1](target_modules=["linear_q", "linear_fc1_up"], dim=4,
                                             share_expert_adapters=False)
    assert dict(canonical.canonical_mapping) == {"linear_qkv": {"linear_q"}, "linear_fc1": {"linear_fc1_up"}}
    assert canonical.share_expert_adapters is False


def test_bridges_own_checks_still_run(classes):
    """Our classes run Bridge's __post_init__: DoRA refuses post-dropout, CanonicalLoRA the fused target names."""
    with pytest.raises(AssertionError, match="dropout_position"):
        classes["dora"][1](dropout_position="post")
    with pytest.raises(AssertionError, match="linear_qkv"):
        classes["canonical_lora"][1](target_modules=["linear_qkv"])


@pytest.mark.parametrize("kind", NEW_KINDS)
@pytest.mark.parametrize("bad", ["shardlocal", "gather", "", "REGATHER", 1, True])
def test_an_invalid_strategy_is_a_value_error_naming_the_class_and_field(classes, kind, bad):
    ours = classes[kind][1]
    with pytest.raises(ValueError, match=f"{ours.__name__}.{FIELD}") as raised:
        ours(sequence_parallel_input_strategy=bad)
    assert "regather" in str(raised.value) and "shard_local" in str(raised.value)


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_the_strategy_is_checked_on_assignment_too(classes, kind):
    peft = classes[kind][1](sequence_parallel_input_strategy="regather")
    with pytest.raises(ValueError, match=FIELD):
        peft.sequence_parallel_input_strategy = "shard-local"
    assert peft.strategy_in_effect == "regather"
    for value, effective in (("shard_local", "shard_local"), ("off", "off"), (None, "off")):
        peft.sequence_parallel_input_strategy = value
        assert peft.strategy_in_effect == effective


# ------------------------------------------------------------------------------------------ Bridge's config machinery


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_a_target_dict_instantiates_ours(classes, kind):
    from megatron.bridge.utils.instantiate_utils import instantiate

    ours = classes[kind][1]
    targets = {"dora": ["linear_qkv", "linear_fc1"], "canonical_lora": ["linear_q", "linear_v"]}[kind]
    peft = instantiate({"_target_": f"megatron_bridge_ext.peft.{ours.__name__}", "target_modules": targets, "dim": 16,
                        FIELD: "shard_local"})
    assert type(peft) is ours
    assert (peft.target_modules, peft.dim, peft.strategy_in_effect) == (targets, 16, "shard_local")


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_hydra_target_override_creates_ours(classes, kind):
    pytest.importorskip("hydra", reason="Bridge's override parser (omegaconf_utils) imports hydra-core")
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    @dataclasses.dataclass
    class RunConfig:
        peft: object = None

    ours = classes[kind][1]
    cfg = process_config_with_overrides(RunConfig(), cli_overrides=[
        f"+peft._target_=megatron_bridge_ext.peft.{ours.__name__}", "+peft.dim=8", f"+peft.{FIELD}=regather"])
    assert type(cfg.peft) is ours
    assert (cfg.peft.dim, cfg.peft.strategy_in_effect) == (8, "regather")


# ------------------------------------------------------------------------------------------ kinds


def test_kind_of_knows_bridges_classes_and_ours(classes):
    for kind in kinds.KINDS:
        assert kinds.kind_of(kinds.bridge_class(kind)()) == kind
        assert kinds.kind_of(kinds.our_class(kind)()) == kind
    assert kinds.kind_of(object()) is None and kinds.kind_of(None) is None


def test_target_names_and_the_layers_they_adapt():
    layers = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    canonical = kinds.target_names("canonical_lora", layers)
    assert canonical == ["linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_up", "linear_fc1_gate",
                         "linear_fc2"]
    assert kinds.target_names("dora", layers) == layers
    assert kinds.targeted_layers(canonical) == set(layers)
    assert kinds.targeted_layers(["linear_k", "linear_fc1_gate"]) == {"linear_qkv", "linear_fc1"}


def test_an_unknown_kind_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"--peft='qlora'.*lora, dora, canonical_lora"):
        kinds.check_kind("qlora", "--peft")
