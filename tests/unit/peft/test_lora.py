"""Our LoRA as a configuration object, in one process (no ranks).

* drop-in: every field of Bridge's LoRA, with Bridge's defaults, plus our two fields;
* the strategy fields: resolution and validation (at construction and on assignment);
* Bridge's config machinery: ``_target_`` instantiation, a run config's ``cfg.peft`` round trip
  through a dict and YAML, and Hydra-style overrides (these need hydra-core).
"""

from __future__ import annotations

import dataclasses
import re
import logging

import pytest

from tests.support.peft import FIELD

pytestmark = [pytest.mark.unit]


def _bridge_lora_class():
    from megatron.bridge.peft.lora import LoRA as BridgeLoRA

    return BridgeLoRA


def _defaults(cls) -> dict:
    return {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls) if f.init}


# ------------------------------------------------------------------------------------------ drop-in


def test_every_bridge_field_is_accepted_with_bridges_default(ours):
    bridge, defaults = _defaults(_bridge_lora_class()), _defaults(ours)
    assert issubclass(ours, _bridge_lora_class())
    assert {name: defaults[name] for name in bridge} == bridge
    assert set(defaults) - set(bridge) <= {"sequence_parallel_input_regather", FIELD}
    assert defaults[FIELD] is None and defaults["sequence_parallel_input_regather"] is False


def test_bridge_fields_pass_through(ours):
    lora = ours(target_modules=["linear_qkv"], dim=4, alpha=8, dropout=0.1, lora_A_init_method="kaiming")
    assert (lora.target_modules, lora.dim, lora.alpha, lora.dropout, lora.lora_A_init_method) == (
        ["linear_qkv"], 4, 8, 0.1, "kaiming",
    )
    assert lora.report() == []


# ------------------------------------------------------------------------------------------ strategy fields


@pytest.mark.parametrize(
    "regather_flag, strategy, effective",
    [
        (False, None, "off"),
        (False, "off", "off"),
        (True, None, "regather"),
        (False, "regather", "regather"),
        (False, "shard_local", "shard_local"),
        (True, "regather", "regather"),
    ],
)
def test_strategy_resolution(ours, regather_flag, strategy, effective):
    lora = ours(sequence_parallel_input_regather=regather_flag, sequence_parallel_input_strategy=strategy)
    assert lora.strategy_in_effect == effective


@pytest.mark.parametrize("strategy", ["shard_local", "off"])
def test_the_upstream_flag_and_another_strategy_are_refused_not_resolved(ours, strategy):
    with pytest.raises(ValueError, match="sequence_parallel_input_regather=True asks for regather"):
        ours(sequence_parallel_input_regather=True, sequence_parallel_input_strategy=strategy)
    lora = ours(sequence_parallel_input_strategy=strategy)
    with pytest.raises(ValueError, match="Fix: drop sequence_parallel_input_regather"):
        lora.sequence_parallel_input_regather = True
    assert lora.strategy_in_effect == strategy


@pytest.mark.parametrize("bad", ["no", "False", 0, 1, None])
def test_the_upstream_flag_must_be_a_bool(ours, bad):
    with pytest.raises(ValueError, match="sequence_parallel_input_regather=.* is not a bool"):
        ours(sequence_parallel_input_regather=bad)


@pytest.mark.parametrize("bad", ["shardlocal", "gather", "", "REGATHER", 1, True])
def test_an_invalid_strategy_is_a_value_error_naming_the_field(ours, bad):
    with pytest.raises(ValueError, match=FIELD) as raised:
        ours(sequence_parallel_input_strategy=bad)
    assert "regather" in str(raised.value) and "shard_local" in str(raised.value)


@pytest.mark.parametrize("kind", ["lora", "dora", "canonical_lora"])
@pytest.mark.parametrize("typo, meant", [("shard_lcoal", "shard_local"), ("regahter", "regather"), ("of", "off")])
def test_a_misspelt_strategy_names_the_value_the_choices_and_the_closest_one(kind, typo, meant):
    from megatron_bridge_ext.peft import kinds

    cls = kinds.our_class(kind)
    with pytest.raises(ValueError) as raised:
        cls(sequence_parallel_input_strategy=typo)
    assert str(raised.value) == (f"{cls.__name__}.{FIELD}={typo!r} is not valid. Fix: use one of 'off', 'regather', "
                                 f"'shard_local', None (did you mean {meant!r}?)")


def test_an_invalid_strategy_is_refused_on_assignment_too(ours):
    """Bridge's overrides set fields on an existing object: an unknown name must not run as a strategy."""
    lora = ours(sequence_parallel_input_strategy="regather")
    with pytest.raises(ValueError, match=FIELD):
        lora.sequence_parallel_input_strategy = "shard-local"
    assert lora.strategy_in_effect == "regather"
    lora.sequence_parallel_input_strategy = "shard_local"
    assert lora.strategy_in_effect == "shard_local"
    lora.sequence_parallel_input_strategy = "off"
    assert lora.strategy_in_effect == "off"
    lora.sequence_parallel_input_strategy = None
    assert lora.strategy_in_effect == "off"


# ------------------------------------------------------------------------------------------ Bridge's config machinery


def _instantiate(config: dict):
    from megatron.bridge.utils.instantiate_utils import instantiate

    return instantiate(config)


@pytest.mark.parametrize("target", ["megatron_bridge_ext.peft.LoRA", "megatron_bridge_ext.peft.lora.LoRA"])
def test_a_target_dict_instantiates_our_lora(ours, target):
    lora = _instantiate(
        {"_target_": target, "target_modules": ["linear_qkv", "linear_fc1"], "dim": 16, "alpha": 32, FIELD: "shard_local"}
    )
    assert type(lora) is ours
    assert (lora.target_modules, lora.dim, lora.alpha, lora.strategy_in_effect) == (["linear_qkv", "linear_fc1"], 16, 32, "shard_local")


def test_a_target_dict_with_an_invalid_strategy_fails_naming_the_field(ours):
    with pytest.raises(Exception) as raised:
        _instantiate({"_target_": "megatron_bridge_ext.peft.LoRA", FIELD: "shardlocal"})
    cause = raised.value if isinstance(raised.value, ValueError) else raised.value.__cause__
    assert isinstance(cause, ValueError), repr(raised.value)
    assert FIELD in str(cause) and FIELD in str(raised.value)


def test_bridge_allows_our_targets(ours):
    """Bridge instantiates only allowlisted module prefixes; importing our LoRA adds this package."""
    from megatron.bridge.utils.instantiate_utils import target_allowlist

    assert target_allowlist.is_allowed("megatron_bridge_ext.peft.LoRA")
    assert not target_allowlist.is_allowed("megatron_bridge_extras.LoRA")  # a prefix at a module boundary


def test_cfg_peft_round_trips_through_a_run_config_dict_and_yaml(ours):
    """A run config serialises ``cfg.peft`` with ``_target_`` (ConfigContainer.to_dict / to_yaml)
    and instantiates it back when loaded: it must come back as our LoRA with the same fields."""
    import yaml
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase
    from megatron.bridge.utils.yaml_utils import dump_dataclass_to_yaml

    lora = ours(target_modules=["linear_qkv"], dim=8, alpha=16, sequence_parallel_input_strategy="shard_local")
    as_dict = _ConfigContainerBase._convert_value_to_dict(lora)
    assert as_dict["_target_"] == "megatron_bridge_ext.peft.lora.LoRA"
    assert as_dict[FIELD] == "shard_local"
    for restored in (_instantiate(as_dict), _instantiate(yaml.safe_load(dump_dataclass_to_yaml(as_dict)))):
        assert type(restored) is ours
        assert _defaults_of(restored) == _defaults_of(lora)


def _defaults_of(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init and f.name != "canonical_mapping"}


# Hydra-style overrides go through megatron.bridge.training.utils.omegaconf_utils, which imports
# hydra-core at module level. Bridge converts the run config to OmegaConf without the values it
# considers callables, and every PEFT object is one (``peft(model)``): an existing ``cfg.peft`` is
# left out and put back after the overrides, so overrides can only create the PEFT where
# ``cfg.peft`` is None, through ``_target_``.
_NO_HYDRA = "hydra-core is not installed: Bridge's override parser (omegaconf_utils) imports it; install hydra-core to run"


@dataclasses.dataclass
class _RunConfig:
    peft: object = None


def _omegaconf_utils():
    pytest.importorskip("hydra", reason=_NO_HYDRA)
    from megatron.bridge.training.utils import omegaconf_utils

    return omegaconf_utils


def _process_overrides(cfg, overrides: list[str]):
    return _omegaconf_utils().process_config_with_overrides(cfg, cli_overrides=overrides)


def test_hydra_target_override_creates_our_lora(ours):
    cfg = _process_overrides(
        _RunConfig(),
        ["+peft._target_=megatron_bridge_ext.peft.LoRA", "+peft.dim=8", f"+peft.{FIELD}=shard_local"],
    )
    assert type(cfg.peft) is ours
    assert (cfg.peft.dim, cfg.peft.strategy_in_effect) == (8, "shard_local")


def test_hydra_overrides_cannot_change_an_existing_peft_object(ours):
    """What our LoRA's docstring states: with ``cfg.peft`` set, Bridge refuses field overrides and
    puts the original object back over a ``_target_`` override."""
    OverridesError = _omegaconf_utils().OverridesError
    lora = ours(dim=8, sequence_parallel_input_strategy="regather")
    with pytest.raises(OverridesError, match=FIELD):
        _process_overrides(_RunConfig(peft=lora), [f"peft.{FIELD}=shard_local"])
    bridge_lora = _bridge_lora_class()(dim=8)
    cfg = _process_overrides(_RunConfig(peft=bridge_lora), ["+peft._target_=megatron_bridge_ext.peft.LoRA"])
    assert cfg.peft is bridge_lora


def test_hydra_target_override_with_an_invalid_strategy_names_the_field(ours, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = _process_overrides(_RunConfig(), ["+peft._target_=megatron_bridge_ext.peft.LoRA", f"+peft.{FIELD}=bogus"])
    assert not isinstance(cfg.peft, ours)  # Bridge logs the failure instead of raising
    assert any(FIELD in record.getMessage() and "bogus" in record.getMessage() for record in caplog.records)


def test_the_demo_knows_from_the_version_whether_bridge_has_the_regather_flag(ours):
    """demo.variants decides without importing Bridge; Bridge's own LoRA fields are the check."""
    from dataclasses import fields

    from megatron.bridge.peft.lora import LoRA as BridgeLoRA

    from megatron_bridge_ext.testing.variants import VARIANTS

    has_field = "sequence_parallel_input_regather" in {f.name for f in fields(BridgeLoRA)}
    assert VARIANTS["upstream_regather"].available("lora")[0] is has_field


@pytest.mark.parametrize("fields, fragment", [
    (dict(dim=0), "dim=0 is not a whole number of 1 or more"),
    (dict(dim=-4), "dim=-4 is not a whole number of 1 or more"),
    (dict(dim="16"), "dim='16' is not a whole number of 1 or more"),
    (dict(dim=True), "dim=True is not a whole number"),
    (dict(alpha=0), "alpha=0 is not a positive number"),
    (dict(target_modules="linear_qkv"), "target_modules='linear_qkv' is one string, which would be read letter by "
                                        "letter. Fix: write a list, target_modules=['linear_qkv']"),
    (dict(target_modules=["linear_qkv", 3]), "target_modules=['linear_qkv', 3] is not a list of module names"),
], ids=["dim-0", "dim-negative", "dim-string", "dim-bool", "alpha-0", "targets-string", "targets-not-names"])
def test_a_field_that_would_build_nothing_is_refused_at_construction(ours, fields, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        ours(**fields)
    assert ours(dim=8, alpha=16, target_modules=("linear_qkv",)).dim == 8
