"""Our LoRA as a configuration object, and the eligibility rules, in one process (no ranks).

* drop-in: every field of Bridge's LoRA, with Bridge's defaults, plus our two fields;
* the strategy fields: resolution and validation (at construction and on assignment);
* Bridge's config machinery: ``_target_`` instantiation, a run config's ``cfg.peft`` round trip
  through a dict and YAML, and Hydra-style overrides (these need hydra-core);
* eligibility.py's rules, table-driven, on stand-ins for Bridge's LoRALinear.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_bridge_ext.levers.lora_input.eligibility import ELIGIBLE_SURFACES, Decision, decide, ineligibility

pytestmark = [pytest.mark.unit]

STRATEGIES = ("regather", "shard_local")
FIELD = "sequence_parallel_input_strategy"


@pytest.fixture(scope="module")
def ours():
    """Our LoRA class. Importing it applies the upstream patches to this process; they are reverted
    when this module's tests are done, so that later tests in the process find upstream unpatched."""
    from megatron_bridge_ext.patches import revert_all
    from megatron_bridge_ext.peft import LoRA

    yield LoRA
    revert_all()


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


# ------------------------------------------------------------------------------------------ eligibility rules


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _stand_in(
    *,
    surface="linear_qkv",
    row_parallel=False,
    sequence_parallel=True,
    tp=2,
    tp_group=True,
    expert=False,
    a2a=False,
    base_sequence_parallel=True,
    parallel_mode="column",
    explicit_expert_comm=False,
    lora_a_trainable=True,
    activation=None,
    cuda_graph_impl="none",
    enable_cuda_graph=False,
    cpu_offloading=False,
    cpu_offloading_activations=False,
    recompute_granularity=None,
    recompute_modules=None,
    te=False,
):
    """The attributes of Bridge's LoRALinear (adapter, to_wrap and their configs) that the rules read."""
    config = SimpleNamespace(
        sequence_parallel=sequence_parallel, tensor_model_parallel_size=tp, cuda_graph_impl=cuda_graph_impl,
        enable_cuda_graph=enable_cuda_graph, cpu_offloading=cpu_offloading,
        cpu_offloading_activations=cpu_offloading_activations, recompute_granularity=recompute_granularity,
        recompute_modules=recompute_modules,
    )
    adapter = SimpleNamespace(
        base_linear_name=f"decoder.layers.3.block.{surface}", input_is_parallel=row_parallel,
        tp_group=_Group(tp) if tp_group else None, config=config, is_expert=expert, use_a2a=a2a,
        linear_in=SimpleNamespace(weight=torch.zeros(2, 2, requires_grad=lora_a_trainable)),
        activation=activation if activation is not None else nn.Identity(),
    )
    base = SimpleNamespace(config=config, sequence_parallel=base_sequence_parallel, parallel_mode=parallel_mode,
                           explicit_expert_comm=explicit_expert_comm)
    if te:  # a TE LayerNorm-linear can return its norm output
        base.return_layernorm_output_gathered = False
    return SimpleNamespace(adapter=adapter, to_wrap=base)


BOTH = STRATEGIES
# (case, stand-in fields, strategies that refuse it, reason fragment)
RULES = [
    ("row-parallel surface", dict(surface="linear_proj"), BOTH, "linear_proj is not a column-parallel LoRA target"),
    ("row-parallel adapter", dict(row_parallel=True), BOTH, "the adapter is row-parallel"),
    ("SP off", dict(sequence_parallel=False), BOTH, "sequence parallelism is off"),
    ("TP=1 from the group", dict(tp=1), BOTH, "tensor parallel size is 1"),
    ("TP=1 from the config", dict(tp=1, tp_group=False), BOTH, "tensor parallel size is 1"),
    ("expert", dict(surface="linear_fc1", expert=True), BOTH, "expert adapters are not supported"),
    ("all-to-all", dict(a2a=True), BOTH, "all-to-all adapters are not supported"),
    ("base without SP", dict(base_sequence_parallel=False), BOTH, "does no sequence-parallel communication"),
    ("TE base with parallel_mode=None", dict(parallel_mode=None), BOTH, "does no sequence-parallel communication"),
    ("shared expert with explicit comm", dict(surface="linear_fc1", explicit_expert_comm=True), BOTH,
     "does no sequence-parallel communication"),
    ("frozen LoRA-A", dict(lora_a_trainable=False), BOTH, "LoRA-A is frozen"),
    ("non-identity activation", dict(activation=nn.SiLU()), BOTH, "activation is not identity"),
    ("CUDA graphs (impl)", dict(cuda_graph_impl="local"), BOTH, "CUDA graphs are enabled"),
    ("CUDA graphs (legacy flag)", dict(enable_cuda_graph=True), BOTH, "CUDA graphs are enabled"),
    ("CPU activation offloading", dict(cpu_offloading=True, cpu_offloading_activations=True), BOTH,
     "CPU activation offloading is enabled"),
    ("CPU weight offloading only", dict(cpu_offloading=True), (), None),
    ("full recompute", dict(recompute_granularity="full"), ("regather",), "full activation recompute"),
    ("mlp recompute, linear_fc1", dict(surface="linear_fc1", recompute_granularity="selective", recompute_modules=["mlp"]),
     ("regather",), "selective 'mlp' recompute"),
    ("mlp recompute, linear_qkv", dict(recompute_granularity="selective", recompute_modules=["mlp"]), (), None),
    ("core_attn recompute, linear_fc1", dict(surface="linear_fc1", recompute_granularity="selective",
                                             recompute_modules=["core_attn"]), (), None),
    ("eligible linear_qkv", dict(), (), None),
    ("eligible linear_fc1", dict(surface="linear_fc1"), (), None),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case, fields, refused_by, reason", RULES, ids=[r[0] for r in RULES])
def test_eligibility_rule(strategy, case, fields, refused_by, reason):
    lora_linear = _stand_in(**fields)
    decision = decide(lora_linear, strategy)
    assert decision.adapter == lora_linear.adapter.base_linear_name and decision.requested == strategy
    if strategy in refused_by:
        assert (decision.strategy, decision.eligible) == ("off", False)
        assert reason in decision.reason
    else:
        assert (decision.strategy, decision.eligible, decision.reason) == (strategy, True, "eligible")
        assert ineligibility(lora_linear, strategy) is None


def test_no_strategy_requested_is_off_for_every_adapter():
    decision = decide(_stand_in(), "off")
    assert decision == Decision(decision.adapter, "off", "off", "off (no strategy requested)",
                                "the gathered input [s, b, h]", f"{decision.adapter}.adapter.linear_in")
    assert not decision.eligible


@pytest.mark.parametrize("case, fields, strategy, retains", [
    ("column, eligible, local spec", dict(), "shard_local", "s*b*h*(1-1/t)"),
    ("column, eligible, TE", dict(te=True), "regather", "the storage TE keeps"),
    ("column, off", dict(), "off", "the gathered input [s, b, h]"),
    ("column, SP off", dict(sequence_parallel=False), "shard_local", "no sequence parallelism"),
    ("row-parallel", dict(surface="linear_proj", row_parallel=True), "shard_local", "already split over TP"),
    ("frozen LoRA-A", dict(lora_a_trainable=False), "shard_local", "nothing"),
])
def test_report_says_what_lora_a_retains(case, fields, strategy, retains):
    assert retains in decide(_stand_in(**fields), strategy).retains


def test_the_demo_knows_from_the_version_whether_bridge_has_the_regather_flag(ours):
    """demo.variants decides without importing Bridge; Bridge's own LoRA fields are the check."""
    from dataclasses import fields

    from megatron.bridge.peft.lora import LoRA as BridgeLoRA

    from megatron_bridge_ext.testing.variants import VARIANTS

    has_field = "sequence_parallel_input_regather" in {f.name for f in fields(BridgeLoRA)}
    assert VARIANTS["upstream_regather"].available("lora")[0] is has_field


def _assigned_attributes(module_name: str, class_name: str) -> set[str]:
    """Every ``self.<name> = ...`` in a class of an installed module (read from its source)."""
    import ast
    import importlib.util

    source = open(importlib.util.find_spec(module_name).origin).read()
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_the_stand_in_reads_attributes_that_bridge_and_core_really_have(ours):
    """_stand_in's names are the ones ParallelLinearAdapter and ColumnParallelLinear assign (upstream drift fails)."""
    stand_in = _stand_in()
    adapter = _assigned_attributes("megatron.bridge.peft.utils", "ParallelLinearAdapter")
    assert set(vars(stand_in.adapter)) <= adapter, set(vars(stand_in.adapter)) - adapter
    column = _assigned_attributes("megatron.core.tensor_parallel.layers", "ColumnParallelLinear")
    te_only = {"parallel_mode"}  # Transformer Engine's attribute (its modules are not installed here)
    assert set(vars(stand_in.to_wrap)) - te_only <= column, set(vars(stand_in.to_wrap)) - column


@pytest.mark.parametrize("fp8, saving", [(None, "s*b*h elements less"), ("e4m3", "s*b*h*(1-1/t) elements less")])
def test_the_report_states_the_te_saving_with_and_without_fp8(fp8, saving):
    """Under FP8 TE keeps a quantised copy of the shard that LoRA-A cannot share: the report says (1-1/t)."""
    from megatron_bridge_ext.levers.lora_input.eligibility import retained

    wrapper = _stand_in(te=True)
    wrapper.to_wrap.config.fp8 = fp8
    assert saving in retained(wrapper, "shard_local")
