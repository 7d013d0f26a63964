"""MemoryConfig against a real Bridge ConfigContainer from Bridge's ``vanilla_gpt_pretrain_config`` recipe.

That recipe imports and runs on a CPU machine (the model recipes, e.g. llama32_1b_*, fetch a Hugging
Face config from the hub at call time and are not usable offline). The recipe returns a
ConfigContainer with a GPTModelProvider, ``peft=None`` and ``env_vars`` already holding
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
"""

from __future__ import annotations

import pytest

from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.findings import NO_EFFECT, WARNING, Refused
from megatron_bridge_ext.peft import kinds
from megatron_bridge_ext.levers.recompute.config import RECOMPUTE_MODULES

ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_GRAPH_REGISTER", "MBX_ALLOCATOR_IPC")


@pytest.fixture(scope="module")
def bridge():
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.peft.lora import LoRA as BridgeLoRA
    from megatron.bridge.recipes.gpt import vanilla_gpt_pretrain_config

    return vanilla_gpt_pretrain_config, BridgeLoRA


@pytest.fixture
def cfg(bridge, monkeypatch):
    for name in ALLOC_VARS:
        monkeypatch.delenv(name, raising=False)
    recipe, bridge_lora = bridge
    config = recipe()
    config.model.tensor_model_parallel_size = 2
    config.model.sequence_parallel = True
    config.peft = bridge_lora(dim=16, alpha=32, target_modules=["linear_qkv", "linear_fc1"])
    return config


def _errors(flags: MemoryConfig, cfg) -> str:
    with pytest.raises(Refused) as info:
        flags.validate(cfg)
    return str(info.value)


def test_apply_sets_recompute_peft_and_reports_every_change(cfg):
    from megatron_bridge_ext.peft import LoRA

    summary = MemoryConfig(sequence_parallel_input_strategy="shard_local", recompute_modules=["core_attn"]).apply(cfg)

    assert cfg.model.recompute_granularity == "selective"
    assert cfg.model.recompute_modules == ["core_attn"]
    assert type(cfg.peft) is LoRA
    assert (cfg.peft.dim, cfg.peft.alpha, cfg.peft.target_modules) == (16, 32, ["linear_qkv", "linear_fc1"])
    assert cfg.peft.sequence_parallel_input_strategy == "shard_local"
    changed = {c.field: (c.old, c.new) for c in summary.changes}
    assert changed["model.recompute_granularity"] == (None, "selective")
    assert changed["model.recompute_modules"][1] == ["core_attn"]
    assert changed["peft.sequence_parallel_input_strategy"] == ("off", "shard_local")
    assert "peft" in changed
    text = str(summary)
    assert "model.recompute_modules" in text and "shard_local" in text


def test_apply_keeps_the_users_recompute_modules_and_says_so(cfg):
    cfg.model.recompute_granularity = "selective"
    cfg.model.recompute_modules = ["layernorm"]
    summary = MemoryConfig(recompute_modules=["core_attn"], expandable_segments=False).apply(cfg)
    assert cfg.model.recompute_modules == ["layernorm", "core_attn"]
    (change,) = [c for c in summary.changes if c.field == "model.recompute_modules"]
    assert "layernorm" in change.note


def test_apply_fills_env_vars_and_keeps_other_user_options(cfg):
    cfg.env_vars = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8", "OTHER": "1"}
    summary = MemoryConfig().apply(cfg)
    value = cfg.env_vars["PYTORCH_CUDA_ALLOC_CONF"]
    assert "expandable_segments:True" in value and "garbage_collection_threshold:0.8" in value
    assert cfg.env_vars["OTHER"] == "1"
    assert any(c.field == "env_vars.PYTORCH_CUDA_ALLOC_CONF" for c in summary.changes)


def test_expandable_segments_false_turns_off_what_the_recipes_env_vars_turn_on(cfg):
    """A recipe that sets expandable_segments:True in env_vars: MemoryConfig(expandable_segments=False) writes False in
    its place, keeps the other options, and reports the change (it used to report nothing and leave them on)."""
    cfg.env_vars = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True", "OTHER": "1"}
    summary = MemoryConfig(expandable_segments=False).apply(cfg)
    assert cfg.env_vars == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:False", "OTHER": "1"}
    assert [(c.field, c.old, c.new) for c in summary.changes if c.field.startswith("env_vars")] == [
        ("env_vars.PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True",
         "max_split_size_mb:512,expandable_segments:False")]


@pytest.mark.parametrize("field, value, words", [
    ("dim", 0, "peft.dim"), ("dim", -4, "peft.dim"), ("dim", "16", "peft.dim"),
    ("target_modules", "linear_qkv", "peft.target_modules"),
], ids=["dim-0", "dim-negative", "dim-string", "targets-a-string"])
def test_a_bridge_lora_with_a_field_that_builds_nothing_is_refused_by_validate(cfg, field, value, words):
    """Bridge's own LoRA takes these values; MemoryConfig.validate names the field instead of spelling a string's
    letters as module names."""
    setattr(cfg.peft, field, value)
    with pytest.raises(Refused) as error:
        MemoryConfig().validate(cfg)
    text = error.value.one_line()
    assert text.startswith(f"{words}:") and "['l', 'i'" not in text


@pytest.mark.parametrize(
    "flags, model_fields, expected",
    [
        (MemoryConfig(recompute_modules=["moe_act"]), {}, "'moe_act' needs grouped GEMM"),
        (MemoryConfig(recompute_modules=["mla_up_proj"]), {}, "'mla_up_proj' needs multi-latent attention"),
        (MemoryConfig(recompute_modules=["core_attn"]), {"cpu_offloading": True}, "CPU offloading cannot be combined"),
        (MemoryConfig(), {"cpu_offloading": True, "pipeline_model_parallel_size": 2}, "CPU offloading needs pipeline parallel size 1"),
        (MemoryConfig(), {"recompute_granularity": "full", "cuda_graph_impl": "local"}, "full recompute with per-layer CUDA graphs"),
        (MemoryConfig(), {"distribute_saved_activations": True}, "distribute_saved_activations"),
    ],
    ids=["moe_act", "mla_up_proj", "offload+recompute", "offload+pp", "full+graphs", "distribute+sp"],
)
def test_each_invalid_combination_is_refused_with_its_fix(cfg, flags, model_fields, expected):
    for name, value in model_fields.items():
        setattr(cfg.model, name, value)
    message = _errors(flags, cfg)
    assert expected in message
    assert "Fix:" in message


def test_lora_input_without_a_lora_peft_is_refused(cfg):
    cfg.peft = None
    assert "needs a LoRA PEFT config" in _errors(MemoryConfig(sequence_parallel_input_strategy="regather"), cfg)


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False)])
def test_lora_input_without_sequence_parallelism_says_it_has_no_effect(cfg, tp, sp):
    cfg.model.tensor_model_parallel_size, cfg.model.sequence_parallel = tp, sp
    findings = MemoryConfig(sequence_parallel_input_strategy="shard_local").validate(cfg)
    assert any(f.level == NO_EFFECT and "no effect" in f.message for f in findings)


def test_core_attn_on_unfused_attention_states_the_trade(cfg):
    from megatron.bridge.models.gpt_provider import local_layer_spec

    cfg.model.transformer_layer_spec = local_layer_spec  # Megatron Core's unfused DotProductAttention
    findings = MemoryConfig(recompute_modules=["core_attn"]).validate(cfg)
    (core,) = [f for f in findings if "core_attn" in f.message]
    assert core.level == WARNING and "s x s" in core.message


def test_allocator_guard_refuses_a_conflicting_nccl_graph_register(cfg):
    cfg.model.cuda_graph_impl = "local"
    cfg.env_vars = dict(cfg.env_vars or {}, NCCL_GRAPH_REGISTER="1")
    assert "NCCL_GRAPH_REGISTER" in _errors(MemoryConfig(), cfg)


def test_invalid_lora_input_value_names_the_flag():
    with pytest.raises(ValueError, match="sequence_parallel_input_strategy"):
        MemoryConfig(sequence_parallel_input_strategy="sharded")


def test_recompute_module_names_match_the_installed_megatron_core():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bridge_ext.levers.recompute.config import RECOMPUTE_MODULES

    def build(modules):
        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, recompute_granularity="selective",
                                 recompute_modules=modules)

    with pytest.raises(AssertionError, match="Invalid choices"):
        build(["not_a_module"])
    for name in RECOMPUTE_MODULES:
        try:
            build([name])
        except AssertionError as exc:  # an unknown name is an assertion; prerequisites raise ValueError
            pytest.fail(f"installed Megatron Core rejects {name!r}: {exc}")
        except ValueError:
            pass


def _peft_fields(peft) -> tuple:
    import dataclasses

    return type(peft), {f.name: getattr(peft, f.name) for f in dataclasses.fields(peft) if f.init}


@pytest.mark.parametrize("kind", kinds.KINDS)
def test_overrides_reproduce_apply_where_overrides_built_the_peft(bridge, kind):
    """A PEFT that overrides built (``cfg.peft`` None in the recipe): the user's overrides plus ours, on one
    command line through Bridge's parser, give what apply gives, field for field."""
    pytest.importorskip("hydra", reason="Bridge's override parser needs hydra-core")
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    kinds.our_class(kind)  # importing our class allowlists its _target_ for Bridge
    bridge_target = f"{kinds.bridge_class(kind).__module__}.{kinds.class_name(kind)}"
    users = [f"+peft._target_={bridge_target}", "+peft.dim=16", "+peft.alpha=8", "model.tensor_model_parallel_size=2",
             "model.sequence_parallel=true", "model.recompute_method=uniform"]
    flags = MemoryConfig(sequence_parallel_input_strategy="shard_local", recompute_modules=["core_attn"], expandable_segments=False)

    applied = process_config_with_overrides(bridge[0](), cli_overrides=users)
    printed = flags.overrides(applied, peft_overrides=[])
    assert not flags.peft_needs_python(applied, peft_overrides=[])
    flags.apply(applied)
    overridden = process_config_with_overrides(bridge[0](), cli_overrides=users + printed)

    assert _peft_fields(overridden.peft) == _peft_fields(applied.peft)
    assert type(overridden.peft) is kinds.our_class(kind) and overridden.peft.strategy_in_effect == "shard_local"
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"):
        assert getattr(overridden.model, name) == getattr(applied.model, name), name
    assert "model.recompute_method=null" in printed  # Megatron Core refuses a method with selective recompute


@pytest.mark.parametrize("kind", kinds.KINDS)
def test_overrides_leave_out_a_peft_object_set_in_python_and_say_so(bridge, cfg, kind):
    pytest.importorskip("hydra", reason="Bridge's override parser needs hydra-core")
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    cfg.peft = kinds.bridge_class(kind)(dim=16, alpha=32)
    flags = MemoryConfig(sequence_parallel_input_strategy="shard_local", recompute_modules=["core_attn"], expandable_segments=False)
    printed = flags.overrides(cfg)
    assert flags.peft_needs_python(cfg)
    assert printed == ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"]
    before = cfg.peft
    assert process_config_with_overrides(cfg, cli_overrides=printed).peft is before  # nothing could reach it


def test_validate_refuses_a_peft_that_bridges_parser_left_a_dict(bridge):
    """A misspelt strategy in an override: Bridge logs that it cannot build our LoRA and keeps the dict;
    validate (and so apply) stops the run with the setting, the value and the valid values."""
    pytest.importorskip("hydra", reason="Bridge's override parser needs hydra-core")
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    kinds.our_class("lora")
    overrides = ["+peft._target_=megatron_bridge_ext.peft.LoRA", "+peft.sequence_parallel_input_strategy=shard_lcoal"]
    cfg = process_config_with_overrides(bridge[0](), cli_overrides=overrides)
    assert isinstance(cfg.peft, dict)  # Bridge's behaviour: it goes on with the dict
    for flags in (MemoryConfig(expandable_segments=False), MemoryConfig(sequence_parallel_input_strategy="shard_local")):
        with pytest.raises(Refused) as info:
            flags.apply(cfg)
        line = info.value.one_line()
        assert line.startswith("peft.sequence_parallel_input_strategy: 'shard_lcoal' is not valid")
        assert "Fix: use one of 'off', 'regather', 'shard_local'" in line and "did you mean 'shard_local'?" in line


def test_validate_changes_and_logs_nothing(cfg, caplog):
    import copy
    import logging

    cfg.env_vars = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8"}
    before_env, before_model = dict(cfg.env_vars), copy.deepcopy(vars(cfg.model))
    with caplog.at_level(logging.INFO, logger="megatron_bridge_ext"):
        MemoryConfig(sequence_parallel_input_strategy="shard_local", recompute_modules=["core_attn"]).validate(cfg)
    assert cfg.env_vars == before_env
    assert cfg.model.recompute_modules == before_model["recompute_modules"]
    assert not [r for r in caplog.records if "cfg.env_vars" in r.getMessage()]


# Each rule MemoryConfig copies from Megatron Core, as the Core TransformerConfig fields that trigger it.
# If Core stops refusing one of these, the copy in MemoryConfig is stale and this test says which.
_CORE_RULES = [
    ("moe_act", dict(recompute_granularity="selective", recompute_modules=["moe_act"], num_moe_experts=4)),
    ("mla_up_proj", dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"])),
    ("offload+recompute", dict(cpu_offloading=True, cpu_offloading_num_layers=1, recompute_granularity="selective")),
    ("offload+pp", dict(cpu_offloading=True, cpu_offloading_num_layers=1, pipeline_model_parallel_size=2)),
    ("full+graphs", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                         cuda_graph_impl="local")),
    ("distribute+sp", dict(distribute_saved_activations=True, sequence_parallel=True, tensor_model_parallel_size=2,
                           recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
]


@pytest.mark.parametrize("case, core_fields", _CORE_RULES, ids=[c[0] for c in _CORE_RULES])
def test_each_copied_core_rule_is_refused_by_megatron_core_too(case, core_fields):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32, **core_fields)
    with pytest.raises((ValueError, AssertionError)):
        TransformerConfig(**fields)
    # and the same fields with the one setting that makes the rule fire taken away are accepted by Core
    relaxed = dict(fields)
    for key, safe in (("cpu_offloading", False), ("cuda_graph_impl", "none"), ("distribute_saved_activations", False)):
        if key in core_fields:
            relaxed[key] = safe
    if case in ("moe_act", "mla_up_proj"):
        relaxed["recompute_modules"] = ["core_attn"]
    TransformerConfig(**relaxed)


@pytest.mark.parametrize("case", [c[0] for c in _CORE_RULES])
def test_memory_config_refuses_each_copied_core_rule(cfg, case):
    flags = {"moe_act": MemoryConfig(recompute_modules=["moe_act"]),
             "mla_up_proj": MemoryConfig(recompute_modules=["mla_up_proj"]),
             "offload+recompute": MemoryConfig(recompute_modules=["core_attn"])}.get(case, MemoryConfig())
    model = {"moe_act": {"num_moe_experts": 4}, "offload+recompute": {"cpu_offloading": True},
             "offload+pp": {"cpu_offloading": True, "pipeline_model_parallel_size": 2},
             "full+graphs": {"recompute_granularity": "full", "cuda_graph_impl": "local"},
             "distribute+sp": {"distribute_saved_activations": True}}.get(case, {})
    for name, value in model.items():
        setattr(cfg.model, name, value)
    assert "Fix:" in _errors(flags, cfg)


def test_lora_recompute_rule_is_eligibility_rule(cfg):
    """MemoryConfig asks lora_input.eligibility: regather warns for linear_fc1 under 'mlp' only, not for linear_qkv."""
    findings = MemoryConfig(sequence_parallel_input_strategy="regather", recompute_modules=["mlp"]).validate(cfg)
    lora = [f for f in findings if f.code == "sequence_parallel_input_strategy_recompute"]
    assert [("linear_fc1" in f.message, "linear_qkv" in f.message) for f in lora] == [(True, False)]
    cfg.peft.target_modules = ["linear_qkv"]
    findings = MemoryConfig(sequence_parallel_input_strategy="regather", recompute_modules=["mlp"]).validate(cfg)
    assert not [f for f in findings if f.code == "sequence_parallel_input_strategy_recompute"]
    assert not [f for f in MemoryConfig(sequence_parallel_input_strategy="shard_local", recompute_modules=["mlp"]).validate(cfg)
                if f.code == "sequence_parallel_input_strategy_recompute"]


@pytest.mark.parametrize("te_version", [None, "2.3.0", "2.8.0"])
def test_apply_fixes_the_te_norm_gradient_for_bridges_own_lora(cfg, monkeypatch, te_version):
    """Whatever the flags, a LoRA-family cfg.peft on TE >= 1.5 gets the patch (from 2.4 every gathered layer needs it,
    before that the layers with Userbuffers rs_dgrad/bulk_wgrad overlap), and the summary says so."""
    from packaging.version import Version

    from megatron_bridge_ext import versions
    from megatron_bridge_ext.patches import bridge_lora_te_norm_grad

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: (Version(te_version) if te_version else None)
                        if name == "transformer-engine" else real(name))
    bridge_lora_te_norm_grad.PATCH.revert()
    try:
        summary = MemoryConfig(expandable_segments=False).apply(cfg)
        applied = bridge_lora_te_norm_grad.PATCH.applied
    finally:
        bridge_lora_te_norm_grad.PATCH.revert()
    actions = [f for f in summary.findings if f.code == "te_norm_grad_patch"]
    assert applied is (te_version is not None)
    assert [f.level for f in actions] == (["action"] if te_version else [])
    assert type(cfg.peft).__module__.startswith("megatron.bridge")  # the user's LoRA object is kept


# ------------------------------------------------------------------ semantics: what apply may produce


@pytest.fixture
def sized(cfg):
    """The recipe's model with real dimensions, so that Megatron Core's own validation (finalize) can run."""
    model = cfg.model
    model.num_layers, model.hidden_size, model.num_attention_heads, model.ffn_hidden_size = 2, 64, 4, 128
    model.seq_length, model.vocab_size = 32, 128
    return cfg


def test_selective_modules_never_silently_replace_full_recompute(sized):
    model = sized.model
    model.recompute_granularity, model.recompute_method, model.recompute_num_layers = "full", "uniform", 1
    message = _errors(MemoryConfig(recompute_modules=["core_attn"], expandable_segments=False), sized)
    assert "recompute_granularity is 'full'" in message and "keeps less activation memory" in message
    assert "leave recompute_modules=None" in message
    assert (model.recompute_granularity, model.recompute_method, model.recompute_num_layers) == ("full", "uniform", 1)


_STARTS = [
    dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None, recompute_modules=None),
    dict(recompute_granularity=None, recompute_method="uniform", recompute_num_layers=None, recompute_modules=None),
    dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None,
         recompute_modules=["layernorm"]),
    dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None,
         recompute_modules=["core_attn"]),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, recompute_modules=None),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2, recompute_modules=None),
]


@pytest.mark.parametrize("start", _STARTS, ids=[f"{s['recompute_granularity']}-{s['recompute_method']}" for s in _STARTS])
@pytest.mark.parametrize("requested", [None, ["core_attn"], ["mlp", "core_attn"], ["layernorm"]])
def test_whatever_apply_produces_passes_megatron_cores_validation(sized, start, requested):
    """Every combination apply can reach is either refused before anything changes, or finalizes in Core."""
    import copy

    for name, value in start.items():
        setattr(sized.model, name, copy.copy(value))
    flags = MemoryConfig(recompute_modules=requested, expandable_segments=False)
    try:
        flags.apply(sized)
    except Refused as refused:
        assert start["recompute_granularity"] == "full" and requested, refused
        assert sized.model.recompute_granularity == "full"  # nothing changed
        return
    sized.model.finalize()  # raises if Megatron Core refuses what apply produced
    if requested:
        assert set(requested) <= set(sized.model.recompute_modules)


def test_the_summary_shows_an_unset_modules_list_as_none(sized):
    summary = MemoryConfig(recompute_modules=["core_attn"], expandable_segments=False).apply(sized)
    (change,) = [c for c in summary.changes if c.field == "model.recompute_modules"]
    assert (change.old, change.new) == (None, ["core_attn"])
    assert "model.recompute_modules: None -> ['core_attn']" in str(summary)


@pytest.mark.parametrize("value, message", [
    ("core_attn", "is not a list of module names"),
    ([], "asks for no module"),
    (["core_attn", "core_attn"], "more than once"),
    ([1], "non-string entries"),
])
def test_recompute_modules_must_be_a_list_of_distinct_names(value, message):
    with pytest.raises(ValueError, match=message) as raised:
        MemoryConfig(recompute_modules=value)
    assert "MemoryConfig.recompute_modules" in str(raised.value) and "Fix:" in str(raised.value)


@pytest.mark.parametrize("name", ["expandable_segments", "allocator_ipc"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_allocator_flags_must_be_bools(name, value):
    with pytest.raises(ValueError, match=f"MemoryConfig.{name}=.* is not a bool"):
        MemoryConfig(**{name: value})


@pytest.mark.parametrize("module", ["moe", "shared_experts"])
def test_moe_modules_on_a_dense_model_say_they_do_nothing(cfg, module):
    findings = MemoryConfig(recompute_modules=[module], expandable_segments=False).validate(cfg)
    (note,) = [f for f in findings if f.code == "recompute_moe_on_dense"]
    assert note.level == NO_EFFECT and module in note.message


def test_replacing_bridges_regather_flag_is_reported(bridge, cfg):
    if "sequence_parallel_input_regather" not in {f.name for f in __import__("dataclasses").fields(bridge[1])}:
        pytest.skip("this Bridge has no sequence_parallel_input_regather")
    cfg.peft = bridge[1](dim=16, alpha=32, target_modules=["linear_qkv"], sequence_parallel_input_regather=True)
    summary = MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False).apply(cfg)
    changed = {c.field: c for c in summary.changes}
    flag = changed["peft.sequence_parallel_input_regather"]
    assert (flag.old, flag.new) == (True, False) and "shard_local" in flag.note
    strategy = changed["peft.sequence_parallel_input_strategy"]
    assert (strategy.old, strategy.new) == ("regather", "shard_local")
    assert cfg.peft.strategy_in_effect == "shard_local" and cfg.peft.sequence_parallel_input_regather is False


def test_off_turns_our_strategy_off_and_says_so(cfg):
    from megatron_bridge_ext.peft import LoRA

    cfg.peft = LoRA(dim=16, alpha=32, sequence_parallel_input_strategy="shard_local")
    summary = MemoryConfig(sequence_parallel_input_strategy="off", expandable_segments=False).apply(cfg)
    (change,) = [c for c in summary.changes if c.field == "peft.sequence_parallel_input_strategy"]
    assert (change.old, change.new) == ("shard_local", "off")
    assert cfg.peft.strategy_in_effect == "off"


def test_apply_on_our_own_lora_changes_only_the_strategy(cfg):
    from megatron_bridge_ext.peft import LoRA

    ours = LoRA(dim=16, alpha=32, target_modules=["linear_qkv"], sequence_parallel_input_strategy="regather")
    cfg.peft = ours
    cfg.env_vars = {}  # no allocator setting for expandable_segments=False to turn off
    summary = MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False).apply(cfg)
    assert cfg.peft is ours and ours.strategy_in_effect == "shard_local"
    assert [(c.field, c.old, c.new) for c in summary.changes] == [
        ("peft.sequence_parallel_input_strategy", "regather", "shard_local")]


# ------------------------------------------------------------------------------------------ DoRA and CanonicalLoRA


def _bridge_peft(kind: str, **fields):
    from megatron_bridge_ext.peft import kinds

    targets = kinds.target_names(kind, ["linear_qkv", "linear_proj", "linear_fc1"])
    return kinds.bridge_class(kind)(target_modules=targets, dim=16, alpha=32, dropout=0.05, **fields)


@pytest.mark.parametrize("kind, ours", [("dora", "DoRA"), ("canonical_lora", "CanonicalLoRA")])
def test_apply_keeps_the_peft_kind_and_every_field(cfg, kind, ours):
    import dataclasses

    from megatron_bridge_ext.peft import kinds

    cfg.peft = before = _bridge_peft(kind)
    fields = {f.name: getattr(before, f.name) for f in dataclasses.fields(before) if f.init}
    summary = MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False).apply(cfg)

    assert type(cfg.peft) is kinds.our_class(kind) and type(cfg.peft).__name__ == ours
    assert {name: getattr(cfg.peft, name) for name in fields} == fields
    assert cfg.peft.strategy_in_effect == "shard_local"
    changed = {c.field: (c.old, c.new) for c in summary.changes}
    assert changed["peft"] == (f"{type(before).__module__}.{ours}", f"megatron_bridge_ext.peft.{ours}")
    assert changed["peft.sequence_parallel_input_strategy"] == ("off", "shard_local")
    # The user's object is left as it was, and shares no mutable field with the new one.
    assert {f.name: getattr(before, f.name) for f in dataclasses.fields(before) if f.init} == fields
    assert cfg.peft.target_modules is not before.target_modules
    assert cfg.peft.canonical_mapping is not before.canonical_mapping


def test_apply_to_our_own_dora_changes_only_the_strategy(cfg):
    from megatron_bridge_ext.peft import DoRA

    cfg.peft = ours = DoRA(dim=16, sequence_parallel_input_strategy="regather")
    cfg.env_vars = {}  # no allocator setting for expandable_segments=False to turn off
    summary = MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False).apply(cfg)
    assert cfg.peft is ours and ours.strategy_in_effect == "shard_local"
    assert [(c.field, c.old, c.new) for c in summary.changes] == [
        ("peft.sequence_parallel_input_strategy", "regather", "shard_local")]


def test_a_peft_outside_the_lora_family_is_refused_naming_the_kinds(cfg):
    cfg.peft = object()
    message = _errors(MemoryConfig(sequence_parallel_input_strategy="regather"), cfg)
    assert "sequence_parallel_input_strategy" in message and all(name in message for name in ("LoRA", "DoRA", "CanonicalLoRA"))


def test_canonical_targets_get_the_recompute_rule_of_their_layers(cfg):
    """linear_fc1_up/gate are linear_fc1's adapters: regather warns for them under 'mlp', not for q/k/v."""
    cfg.peft = _bridge_peft("canonical_lora")
    findings = [f for f in MemoryConfig(sequence_parallel_input_strategy="regather", recompute_modules=["mlp"]).validate(cfg)
                if f.code == "sequence_parallel_input_strategy_recompute"]
    assert [("linear_fc1" in f.message, "linear_qkv" in f.message) for f in findings] == [(True, False)]


@pytest.mark.parametrize("part", ["model", "peft"])
@pytest.mark.parametrize("method", ["apply", "validate"])
def test_a_part_of_the_config_instead_of_the_container_is_one_clear_refusal(cfg, part, method):
    before = repr(getattr(cfg, part))
    with pytest.raises(Refused) as info:
        getattr(MemoryConfig(sequence_parallel_input_strategy="shard_local"), method)(getattr(cfg, part))
    text = info.value.one_line()
    assert f"MemoryConfig.{method}(cfg) takes Bridge's ConfigContainer" in text
    assert type(getattr(cfg, part)).__name__ in text and f"{method}(cfg), not cfg.model" in text
    assert repr(getattr(cfg, part)) == before  # nothing was set on it


@pytest.mark.parametrize("kind", kinds.KINDS)
def test_hugging_face_target_names_are_refused_with_the_megatron_names(cfg, kind):
    hf = {"lora": ["linear_qkv", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc1", "linear_fc2"],
          "dora": ["linear_qkv", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc1", "linear_fc2"],
          "canonical_lora": ["linear_q", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"]}
    targets = ["q_proj", "*.layers.0.*.v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg.peft = kinds.bridge_class(kind)(dim=16, target_modules=["linear_proj"])
    cfg.peft.target_modules = targets  # CanonicalLoRA checks its names at construction; set them afterwards
    with pytest.raises(Refused) as info:
        MemoryConfig(sequence_parallel_input_strategy="shard_local").apply(cfg)
    (error,) = info.value.findings
    assert error.setting == "peft.target_modules" and str(targets) in error.message
    expected = [*hf[kind][:1], "*.layers.0.*." + hf[kind][1], *hf[kind][2:]]
    for target, name in zip(targets, expected):
        assert f"{target} -> {name}" in error.fix
    assert kinds.kind_of(cfg.peft) == kind and cfg.peft.target_modules == targets  # nothing applied


@pytest.mark.parametrize("kind, targets", [
    ("lora", ["linear_qkv", "*.layers.0.*.linear_fc2", "decoder.layers.1.self_attention.linear_proj", "*.layers.3.*"]),
    ("canonical_lora", ["linear_q", "linear_k", "linear_v", "linear_fc1_up", "linear_fc1_gate", "linear_proj",
                        "*.layers.0.*.linear_q"]),
])
def test_megatron_target_names_and_wildcards_pass(cfg, kind, targets):
    cfg.peft = kinds.bridge_class(kind)(dim=16, target_modules=targets)
    findings = MemoryConfig(sequence_parallel_input_strategy="shard_local").validate(cfg)
    assert not [f for f in findings if f.setting == "peft.target_modules"], findings


def test_a_target_that_names_no_megatron_module_is_a_no_effect_finding(cfg):
    cfg.peft.target_modules = ["linear_qkv", "linear_qvk"]
    findings = MemoryConfig(sequence_parallel_input_strategy="shard_local").validate(cfg)
    (found,) = [f for f in findings if f.setting == "peft.target_modules"]
    assert found.level == NO_EFFECT and "['linear_qvk']" in found.message and "linear_fc2" in found.fix


def test_the_former_flag_name_still_configures_with_a_deprecation_warning_naming_the_new_one(cfg):
    with pytest.warns(DeprecationWarning, match=r"Fix: write MemoryConfig\(sequence_parallel_input_strategy=\.\.\.\)"):
        former = MemoryConfig(lora_sp_input="shard_local", expandable_segments=False)
    assert former == MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False)
    with pytest.warns(DeprecationWarning, match="sequence_parallel_input_strategy"):
        assert former.lora_sp_input == "shard_local"
    summary = former.apply(cfg)
    assert "peft.sequence_parallel_input_strategy: 'off' -> 'shard_local'" in [str(c) for c in summary.changes]


def test_the_former_and_the_new_flag_name_with_two_values_are_refused():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="two values. Fix: write only "
                                                                           "sequence_parallel_input_strategy"):
        MemoryConfig(lora_sp_input="regather", sequence_parallel_input_strategy="shard_local")


@pytest.mark.parametrize("modules, hint", [(["core_atn"], "did you mean 'core_attn'? "), (["mlp", "xyz"], "")])
def test_an_unknown_recompute_module_is_refused_at_construction(modules, hint):
    """As a misspelt strategy is: the flag is wrong before any config is seen."""
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    with pytest.raises(ValueError) as refused:
        MemoryConfig(recompute_modules=modules)
    assert str(refused.value) == (f"MemoryConfig.recompute_modules names unknown module(s) {unknown}. Fix: {hint}"
                                  f"choose from {list(RECOMPUTE_MODULES)}")
