"""Allocator option strings, the setup plan, every guard, and the three ways in (CPU only)."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bridge_ext.levers import allocator
from megatron_bridge_ext.levers.allocator import runtime as allocator_runtime
from megatron_bridge_ext.findings import Refused
from megatron_bridge_ext.levers.allocator import (
    ALLOC_VAR,
    CUDA_VAR,
    configure_bridge_env,
    plan_allocator,
    setup_allocator,
    verify_allocator,
)
from megatron_bridge_ext.levers.allocator.options import (
    BOOLEAN_KEYS,
    AllocConf,
    AllocatorConfigError,
    Option,
    effective,
    precedence_for,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NEW = "2.14.1"  # the installed torch
OLD = "2.10.0"  # readers disagree: every set variable is written
ANCIENT = "2.7.1"  # only PYTORCH_CUDA_ALLOC_CONF
ES = "expandable_segments:True"


def plan(env, version=NEW, **kw):
    return plan_allocator(env, torch_version=version, **kw)


def codes(findings, level=None):
    return [f.code for f in findings if level is None or f.level == level]


# --------------------------------------------------------------------------------------------
# Parse / render
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "expandable_segments:True",
    "max_split_size_mb:512,expandable_segments:False,garbage_collection_threshold:0.8",
    "roundup_power2_divisions:[256:1,512:2,>:8],backend:native",
    "roundup_power2_divisions:4",
    "my_future_key:42,expandable_segments:True",
    "expandable_segments:False,expandable_segments:True",
])
def test_canonical_strings_round_trip(text):
    conf = AllocConf.parse(text, CUDA_VAR)
    assert conf.render() == text
    assert AllocConf.parse(conf.render()) == conf


def test_list_value_is_kept_item_by_item_and_order_is_preserved():
    conf = AllocConf.parse("a_key:1,roundup_power2_divisions:[256:1,512:2,>:8],z_key:2")
    assert conf.keys() == ["a_key", "roundup_power2_divisions", "z_key"]
    assert conf.get("roundup_power2_divisions") == ("256:1", "512:2", ">:8")


def test_whitespace_and_one_trailing_comma_are_accepted_like_torch():
    conf = AllocConf.parse(" roundup_power2_divisions : [ 256:1 , >:8 ] , expandable_segments : True , ")
    assert conf.render() == "roundup_power2_divisions:[256:1,>:8],expandable_segments:True"


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_value_is_no_options(text):
    assert AllocConf.parse(text).options == ()


def test_duplicated_keys_are_kept_and_the_last_wins():
    conf = AllocConf.parse("expandable_segments:True,max_split_size_mb:256,expandable_segments:False")
    assert conf.flag("expandable_segments") is False
    assert conf.duplicates() == ["expandable_segments"]
    assert conf.render().count("expandable_segments") == 2


def test_with_option_replaces_the_last_occurrence_in_place_or_appends():
    conf = AllocConf.parse("a_key:1,expandable_segments:False,b_key:2")
    assert conf.with_option("expandable_segments", "True").render() == "a_key:1,expandable_segments:True,b_key:2"
    assert AllocConf.parse("a_key:1").with_option("expandable_segments", "True").render() == "a_key:1," + ES


@pytest.mark.parametrize("text, token", [
    ("expandable_segments", "expandable_segments"),
    (":True", ":True"),
    ("expandable_segments:", "expandable_segments:"),
    ("max_split_size_mb:512,,expandable_segments:True", ",,"),
    (",expandable_segments:True", ","),
    ("roundup_power2_divisions:[256:1", "roundup_power2_divisions:[256:1"),
    ("max_split_size_mb:512]", "max_split_size_mb:512]"),
    ("roundup_power2_divisions:[256:[1]]", "roundup_power2_divisions:[256:["),
    ("roundup_power2_divisions:[256:1,,>:8]", "[256:1,,>:8]"),
    ("roundup_power2_divisions:[]", "[]"),
    ("roundup_power2_divisions:[256:1]x", "[256:1]x"),
    ("max_split_size_mb:512:1", "512:1"),
    ("expandable segments:True", "expandable segments"),
    ("expandable_segments:true", "expandable_segments:true"),
    ("expandable_segments:1", "expandable_segments:1"),
    ("9key:1", "9key"),
])
def test_malformed_strings_name_the_variable_and_the_token(text, token):
    with pytest.raises(AllocatorConfigError) as info:
        AllocConf.parse(text, CUDA_VAR)
    message = str(info.value)
    assert message.startswith(f"{CUDA_VAR}={text!r}:")
    assert f"at {token!r}" in message
    assert "Fix:" in message


def test_setup_refuses_malformed_user_value_without_touching_the_environment():
    env = {ALLOC_VAR: "max_split_size_mb:512,,"}
    with pytest.raises(AllocatorConfigError, match=ALLOC_VAR):
        setup_allocator(env, torch_version=NEW)
    assert env == {ALLOC_VAR: "max_split_size_mb:512,,"}


_keys = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
_tokens = st.from_regex(r"[A-Za-z0-9_.>]{1,8}", fullmatch=True)
_values = st.one_of(_tokens, st.lists(st.builds(lambda a, b: f"{a}:{b}", _tokens, _tokens), min_size=1,
                                      max_size=4).map(tuple))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.builds(Option, _keys, _values), max_size=6))
def test_render_then_parse_is_the_identity(options):
    # torch takes only True/False for its boolean keys; the parser enforces that, so skip other values there
    conf = AllocConf(tuple(o for o in options if o.key not in BOOLEAN_KEYS or o.value in ("True", "False")))
    assert AllocConf.parse(conf.render()) == conf


# --------------------------------------------------------------------------------------------
# Which variable
# --------------------------------------------------------------------------------------------


def test_unset_writes_pytorch_alloc_conf_on_new_torch():
    p = plan({})
    assert p.changes == {ALLOC_VAR: (None, ES)}
    assert p.findings == []


def test_user_options_are_kept_in_order():
    env = {CUDA_VAR: "garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,>:8]"}
    p = plan(env)
    assert p.changes == {CUDA_VAR: (env[CUDA_VAR], env[CUDA_VAR] + "," + ES)}
    assert p.findings == []


def test_an_unknown_key_is_refused_before_launch_and_nothing_is_written():
    env = {CUDA_VAR: "garbage_collection_threshold:0.6,my_key:1"}
    p = plan(env)
    assert codes(p.findings, "error") == ["unknown_key"] and "my_key" in p.findings[0].setting
    with pytest.raises(Refused, match="my_key.*Unrecognized key.*Fix: check the spelling of 'my_key'"):
        setup_allocator(env, torch_version=NEW)
    assert env == {CUDA_VAR: "garbage_collection_threshold:0.6,my_key:1"}


@pytest.mark.parametrize("text, key", [("max_split_size_mb:abc", "max_split_size_mb"),
                                       ("garbage_collection_threshold:high", "garbage_collection_threshold"),
                                       ("max_non_split_rounding_mb:-3", "max_non_split_rounding_mb")])
def test_a_number_option_must_be_a_number(text, key):
    with pytest.raises(AllocatorConfigError, match=f"{key}.*torch reads a number here.*Fix: write {key}:<number>"):
        AllocConf.parse(text, ALLOC_VAR)
    assert AllocConf.parse(f"{key}:0.5" if "threshold" in key else f"{key}:512", ALLOC_VAR).get(key)


def test_both_set_new_torch_writes_the_one_it_reads_and_keeps_the_other():
    env = {CUDA_VAR: "max_non_split_rounding_mb:64", ALLOC_VAR: "garbage_collection_threshold:0.7"}
    p = plan(env)
    assert p.changes == {CUDA_VAR: ("max_non_split_rounding_mb:64", "max_non_split_rounding_mb:64," + ES)}
    shadow = [f for f in p.findings if f.code == "shadowed"]
    assert len(shadow) == 1 and shadow[0].setting == ALLOC_VAR and CUDA_VAR in shadow[0].fix


def test_empty_cuda_variable_still_hides_pytorch_alloc_conf():
    p = plan({CUDA_VAR: "", ALLOC_VAR: "garbage_collection_threshold:0.7"})
    assert p.changes == {CUDA_VAR: ("", ES)}
    assert "even an empty value" in [f for f in p.findings if f.code == "shadowed"][0].message


def test_torch_where_readers_disagree_gets_every_set_variable():
    p = plan({CUDA_VAR: "max_non_split_rounding_mb:64", ALLOC_VAR: "garbage_collection_threshold:0.7"}, OLD)
    assert p.changes == {ALLOC_VAR: ("garbage_collection_threshold:0.7", "garbage_collection_threshold:0.7," + ES),
                         CUDA_VAR: ("max_non_split_rounding_mb:64", "max_non_split_rounding_mb:64," + ES)}
    assert plan({}, OLD).changes == {CUDA_VAR: (None, ES)}


def test_old_torch_reads_only_the_cuda_variable():
    p = plan({ALLOC_VAR: "garbage_collection_threshold:0.7"}, ANCIENT)
    assert p.changes == {CUDA_VAR: (None, ES)}
    assert "reads only PYTORCH_CUDA_ALLOC_CONF" in [f for f in p.findings if f.code == "shadowed"][0].message


def test_effective_follows_the_installed_torch_order():
    env = {CUDA_VAR: "max_split_size_mb:64", ALLOC_VAR: ES}
    assert effective(env, (2, 14))[0] == CUDA_VAR
    assert effective(env, (2, 10))[0] == ALLOC_VAR
    assert precedence_for((2, 14)).default_target == ALLOC_VAR


# --------------------------------------------------------------------------------------------
# User choice and guards
# --------------------------------------------------------------------------------------------


def test_explicit_false_wins_with_a_warning_that_says_the_cost():
    p = plan({ALLOC_VAR: "expandable_segments:False"})
    assert p.changes == {} and p.expandable_segments is False
    (warning,) = p.findings
    assert warning.code == "user_disabled" and "58.8 GB" in warning.message and "-28.4%" in warning.message


def test_explicit_true_is_left_alone():
    p = plan({CUDA_VAR: ES})
    assert p.changes == {} and p.expandable_segments is True


def test_duplicate_key_is_reported_and_the_last_value_decides():
    p = plan({ALLOC_VAR: "expandable_segments:True,expandable_segments:False"})
    assert p.changes == {}
    assert codes(p.findings) == ["duplicate_key", "user_disabled"]
    assert "expandable_segments:False" in p.findings[0].message


@pytest.mark.parametrize("version, refused", [("2.10.1", True), ("2.11.0", False), (NEW, False)])
def test_nccl_ub_with_expandable_segments_before_torch_2_11_is_refused_before_launch(version, refused):
    if not refused:
        assert plan({}, version, nccl_ub=True).errors == []
        return
    with pytest.raises(Refused) as info:
        setup_allocator({}, torch_version=version, nccl_ub=True)
    message = str(info.value)
    assert "ddp.nccl_ub" in message and "expandable_segments:False" in message and "torch >= 2.11" in message


def test_nccl_ub_with_user_choice_false_is_fine():
    p = plan({ALLOC_VAR: "expandable_segments:False"}, "2.10.1", nccl_ub=True)
    assert p.errors == []


def test_cuda_graphs_set_nccl_graph_register_when_absent():
    p = plan({}, cuda_graph_impl="transformer_engine")
    assert p.changes["NCCL_GRAPH_REGISTER"] == (None, "0")
    env = {}
    setup_allocator(env, torch_version=NEW, cuda_graph_impl="local")
    assert env == {ALLOC_VAR: ES, "NCCL_GRAPH_REGISTER": "0"}


def test_cuda_graphs_accept_zero_and_refuse_another_user_value():
    assert "NCCL_GRAPH_REGISTER" not in plan({"NCCL_GRAPH_REGISTER": "0"}, cuda_graph_impl="local").changes
    env = {"NCCL_GRAPH_REGISTER": "1"}
    with pytest.raises(Refused, match="NCCL_GRAPH_REGISTER.*is '1'"):
        setup_allocator(env, torch_version=NEW, cuda_graph_impl="local")
    assert env == {"NCCL_GRAPH_REGISTER": "1"}


def test_cuda_graphs_off_or_expandable_off_leave_nccl_graph_register_alone():
    assert "NCCL_GRAPH_REGISTER" not in plan({}, cuda_graph_impl="none").changes
    assert plan({"NCCL_GRAPH_REGISTER": "1", ALLOC_VAR: "expandable_segments:False"},
                cuda_graph_impl="local").errors == []


def test_cuda_malloc_async_is_not_given_expandable_segments():
    p = plan({CUDA_VAR: "backend:cudaMallocAsync"})
    assert p.changes == {} and p.expandable_segments is False
    assert codes(p.findings, "warning") == ["cuda_malloc_async"]
    assert "ignores expandable_segments" in p.findings[0].message


def test_cuda_malloc_async_with_explicit_expandable_segments_is_refused():
    with pytest.raises(Refused, match="backend:cudaMallocAsync"):
        setup_allocator({CUDA_VAR: "backend:cudaMallocAsync," + ES}, torch_version=NEW)


def test_max_split_size_with_expandable_segments_warns_but_keeps_both():
    p = plan({ALLOC_VAR: "max_split_size_mb:512"})
    assert p.changes[ALLOC_VAR][1] == "max_split_size_mb:512," + ES
    (warning,) = [f for f in p.findings if f.level == "warning"]
    assert warning.code == "max_split_size" and "without bound" in warning.message


def test_ipc_processes_keep_expandable_segments_off():
    p = plan({}, ipc=True)
    assert p.changes == {} and p.expandable_segments is False
    assert codes(p.findings) == ["ipc"] and "MBX_ALLOCATOR_IPC" in p.findings[0].setting
    env = {"MBX_ALLOCATOR_IPC": "1"}
    result = setup_allocator(env, torch_version=NEW)
    assert result.changes == {} and ALLOC_VAR not in env


def test_ipc_with_explicit_expandable_segments_warns():
    p = plan({CUDA_VAR: ES}, ipc=True)
    assert p.expandable_segments is True and "cannot" not in p.findings[0].message
    assert "sharing an expandable-segment tensor fails" in p.findings[0].message


def test_ipc_env_value_must_be_yes_or_no():
    with pytest.raises(ValueError, match="MBX_ALLOCATOR_IPC='maybe'"):
        setup_allocator({"MBX_ALLOCATOR_IPC": "maybe"}, torch_version=NEW)


# --------------------------------------------------------------------------------------------
# setup_allocator: result, logging, torch already running
# --------------------------------------------------------------------------------------------


def test_setup_returns_old_and_new_values_and_logs_them(caplog):
    env = {CUDA_VAR: "max_non_split_rounding_mb:64"}
    with caplog.at_level(logging.INFO, logger="megatron_bridge_ext.levers.allocator"):
        result = setup_allocator(env, torch_version=NEW)
    assert env[CUDA_VAR] == "max_non_split_rounding_mb:64," + ES
    assert result.applied == "environment" and result.expandable_segments is True
    assert result.to_dict()["changes"] == {CUDA_VAR: {"old": "max_non_split_rounding_mb:64",
                                                      "new": "max_non_split_rounding_mb:64," + ES}}
    assert any(CUDA_VAR in r.getMessage() and ES in r.getMessage() for r in caplog.records)


def test_setup_twice_changes_nothing_the_second_time():
    env = {}
    setup_allocator(env, torch_version=NEW)
    again = setup_allocator(env, torch_version=NEW)
    assert again.applied == "unchanged" and again.changes == {} and env == {ALLOC_VAR: ES}


@pytest.fixture
def live_env(monkeypatch):
    """This process's environment without allocator variables, torch imported."""
    import torch  # noqa: F401

    for name in (CUDA_VAR, ALLOC_VAR, "MBX_ALLOCATOR_IPC", "NCCL_GRAPH_REGISTER"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cuda_initialised_applies_at_run_time_and_says_so(live_env):
    calls = []
    live_env.setattr(allocator_runtime, "cuda_initialized", lambda: True)
    live_env.setattr(allocator_runtime, "setter", lambda: (calls.append, "torch._C._accelerator_setAllocatorSettings"))
    result = setup_allocator(torch_version=NEW)
    assert calls == [ES]
    assert result.applied == "runtime" and result.cuda_initialized is True
    runtime = [f for f in result.findings if f.code == "runtime"][0]
    assert "CUDA was already initialised" in runtime.message and "old segments" in runtime.message
    assert os.environ[ALLOC_VAR] == ES


def test_cuda_initialised_without_setter_raises_how_to_call_it_earlier(live_env):
    live_env.setattr(allocator_runtime, "cuda_initialized", lambda: True)
    live_env.setattr(allocator_runtime, "setter", lambda: (None, None))
    with pytest.raises(Refused, match=r"megatron_bridge_ext.init\(\) as the first line"):
        setup_allocator(torch_version=NEW)
    assert ALLOC_VAR not in os.environ


def test_torch_imported_with_stale_settings_gets_them_at_run_time(live_env):
    calls = []
    live_env.setattr(allocator_runtime, "cuda_initialized", lambda: False)
    live_env.setattr(allocator_runtime, "setter", lambda: (calls.append, "setter"))
    live_env.setattr(allocator_runtime, "getter", lambda: (lambda: "max_split_size_mb:64"))
    assert setup_allocator(torch_version=NEW).applied == "runtime" and calls == [ES]
    calls.clear()
    live_env.delenv(ALLOC_VAR)
    live_env.setattr(allocator_runtime, "getter", lambda: (lambda: ES))
    assert setup_allocator(torch_version=NEW).applied == "environment" and calls == []


# --------------------------------------------------------------------------------------------
# init() before CUDA, in a child process
# --------------------------------------------------------------------------------------------

_CHILD = """
import json, os, sys
import megatron_bridge_ext
result = megatron_bridge_ext.init()
at_init = {"torch_imported": "torch" in sys.modules,
           "env": {k: os.environ.get(k) for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}}
import torch
at_init["cuda_initialized_after_import"] = torch.cuda.is_initialized()
at_init["torch_reads"] = torch._C._accelerator_getAllocatorSettings()
at_init["result"] = result.to_dict()
print(json.dumps(at_init))
"""


def _child(env_overrides: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (CUDA_VAR, ALLOC_VAR, "MBX_ALLOCATOR_IPC")}
    env.update(env_overrides)
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_init_first_sets_the_variable_before_torch_touches_cuda():
    child = _child({})
    assert child["torch_imported"] is False
    assert child["env"] == {ALLOC_VAR: ES, CUDA_VAR: None}
    assert child["cuda_initialized_after_import"] is False
    assert child["torch_reads"] == ES
    assert child["result"]["applied"] == "environment" and child["result"]["cuda_initialized"] is False


def test_init_keeps_the_users_variables_and_torch_reads_the_merge():
    """Also the fact the torch >= 2.12 branch rests on: with both set, the installed torch reads the CUDA one."""
    child = _child({CUDA_VAR: "garbage_collection_threshold:0.6", ALLOC_VAR: "max_split_size_mb:64"})
    assert child["env"] == {CUDA_VAR: "garbage_collection_threshold:0.6," + ES, ALLOC_VAR: "max_split_size_mb:64"}
    assert child["torch_reads"] == "garbage_collection_threshold:0.6," + ES
    assert [f["code"] for f in child["result"]["findings"]] == ["shadowed"]
    import torch
    from packaging.version import Version

    # metadata, read without importing torch, against what the imported torch says (minus its local +cuXYZ tag)
    assert allocator.installed_torch_version() == Version(torch.__version__).base_version


def test_package_import_stays_cheap():
    code = ("import sys, megatron_bridge_ext, megatron_bridge_ext.levers.allocator, megatron_bridge_ext.diagnose; "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# Bridge recipe path
# --------------------------------------------------------------------------------------------


def _cfg(env_vars=None, nccl_ub=False, cuda_graph_impl="none"):
    return SimpleNamespace(env_vars=dict(env_vars or {}), ddp=SimpleNamespace(nccl_ub=nccl_ub),
                           model=SimpleNamespace(cuda_graph_impl=cuda_graph_impl))


def _bridge_applies(cfg, shell: dict) -> dict:
    """What Bridge 0.6.2 does with cfg.env_vars (setdefault: the shell wins); checked by the next test."""
    env = dict(shell)
    for name, value in cfg.env_vars.items():
        env.setdefault(name, str(value))
    return env


def test_bridge_applies_env_vars_with_setdefault():
    spec = importlib.util.find_spec("megatron.bridge")
    source = Path(spec.submodule_search_locations[0], "training", "config.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.FunctionDef) and n.name == "apply_environment_variables")
    calls = [ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)]
    assert "os.environ.setdefault" in calls and "cfg.env_vars.items" in calls


def test_bridge_env_vars_merge_recipe_defaults_and_reach_the_process():
    cfg = _cfg({CUDA_VAR: "garbage_collection_threshold:0.8", "NCCL_NVLS_ENABLE": 0}, cuda_graph_impl="local")
    result = configure_bridge_env(cfg, environ={}, torch_version=NEW)
    assert cfg.env_vars[CUDA_VAR] == "garbage_collection_threshold:0.8," + ES
    assert cfg.env_vars["NCCL_GRAPH_REGISTER"] == "0" and cfg.env_vars["NCCL_NVLS_ENABLE"] == 0
    assert result.applied == "bridge_env_vars" and result.findings[0].code == "cuda_graphs"
    assert _bridge_applies(cfg, {})[CUDA_VAR] == "garbage_collection_threshold:0.8," + ES


def test_bridge_shell_value_that_disagrees_is_reported():
    shell = {CUDA_VAR: "max_non_split_rounding_mb:64"}
    cfg = _cfg({CUDA_VAR: ES})
    result = configure_bridge_env(cfg, environ=shell, torch_version=NEW)
    wins = [f for f in result.findings if f.code == "shell_wins"]
    assert len(wins) == 1 and "setdefault" in wins[0].message and "export" in wins[0].fix
    assert _bridge_applies(cfg, shell)[CUDA_VAR] == "max_non_split_rounding_mb:64"  # why the warning matters


def test_bridge_shell_value_that_agrees_is_not_reported():
    shell = {CUDA_VAR: ES}
    result = configure_bridge_env(_cfg({}), environ=shell, torch_version=NEW)
    assert result.changes == {} and result.findings == []


def test_bridge_guards_read_the_config():
    with pytest.raises(Refused, match="ddp.nccl_ub"):
        configure_bridge_env(_cfg(nccl_ub=True), environ={}, torch_version="2.10.0")
    with pytest.raises(Refused, match="NCCL_GRAPH_REGISTER"):
        configure_bridge_env(_cfg({"NCCL_GRAPH_REGISTER": 1}, cuda_graph_impl="local"), environ={}, torch_version=NEW)


def test_a_bridge_config_without_an_env_vars_field_is_reported_as_not_applying_them():
    # Bridge 0.5.1's ConfigContainer has no env_vars field: writing one adds a stray attribute Bridge never reads.
    import dataclasses

    @dataclasses.dataclass
    class OldContainer:
        ddp: object = dataclasses.field(default_factory=lambda: SimpleNamespace(nccl_ub=False))
        model: object = dataclasses.field(default_factory=lambda: SimpleNamespace(cuda_graph_impl="none"))

    @dataclasses.dataclass
    class NewContainer(OldContainer):
        env_vars: dict = dataclasses.field(default_factory=dict)

    old = configure_bridge_env(OldContainer(), environ={}, torch_version=NEW)
    new = configure_bridge_env(NewContainer(), environ={}, torch_version=NEW)
    ignored = [f for f in old.findings if f.code == "bridge_ignores_env_vars"]
    assert len(ignored) == 1 and ignored[0].setting == "cfg.env_vars"
    assert "megatron_bridge_ext.init()" in ignored[0].fix and "mbx run" in ignored[0].fix
    assert [f.code for f in new.findings] == []


# --------------------------------------------------------------------------------------------
# verify_allocator on CPU
# --------------------------------------------------------------------------------------------


def test_verify_on_cpu_reports_the_configuration_and_says_it_is_not_verified():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    on = verify_allocator(environ={ALLOC_VAR: ES})
    assert on.on_device is False and on.configured is True and on.in_effect is None
    assert "not verified on a device" in on.message and ALLOC_VAR in on.message
    off = verify_allocator(environ={CUDA_VAR: "", ALLOC_VAR: ES})
    assert off.configured is False


# --------------------------------------------------------------------------------------------
# The user's options survive every path: shell, mbx run, init(), a recipe's env_vars
# (what torch finally reads is asked from torch itself, in a child process)
# --------------------------------------------------------------------------------------------

_TORCH_READS = ("import json, os, torch; print(json.dumps({'reads': torch._C._accelerator_getAllocatorSettings(), "
                "'env': {k: os.environ.get(k) for k in ('PYTORCH_ALLOC_CONF', 'PYTORCH_CUDA_ALLOC_CONF')}}))")


def _torch_reads(env: dict) -> dict:
    """What the installed torch reads from ``env`` (a fresh interpreter, CUDA untouched)."""
    clean = {k: v for k, v in os.environ.items() if k not in (CUDA_VAR, ALLOC_VAR, "MBX_ALLOCATOR_IPC")}
    out = subprocess.run([sys.executable, "-c", _TORCH_READS], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


RECIPE = {CUDA_VAR: ES}  # what Bridge's recipes put in cfg.env_vars


def test_mbx_run_then_a_recipes_env_vars_keep_the_users_options():
    """Shell PYTORCH_ALLOC_CONF, `mbx run`, then Bridge applies a recipe's PYTORCH_CUDA_ALLOC_CONF with setdefault."""
    shell = {ALLOC_VAR: "max_split_size_mb:512"}
    launched = dict(shell)
    result = setup_allocator(launched, torch_version=NEW)  # what mbx run writes into the command's environment
    assert "mirrored" in codes(result.findings)
    after_bridge = _bridge_applies(_cfg(RECIPE), launched)
    reads = AllocConf.parse(_torch_reads(after_bridge)["reads"])
    assert reads.get("max_split_size_mb") == "512" and reads.flag("expandable_segments") is True


def test_without_the_mirror_torch_would_lose_the_users_options():
    """Why the mirror exists: the recipe's variable, set by setdefault, hides the user's on this torch."""
    after_bridge = _bridge_applies(_cfg(RECIPE), {ALLOC_VAR: "max_split_size_mb:512," + ES})
    assert AllocConf.parse(_torch_reads(after_bridge)["reads"]).get("max_split_size_mb") is None


def test_a_recipes_variable_carries_the_shells_options():
    """MemoryConfig.apply / configure_bridge_env on a recipe, with the user's options in the shell."""
    shell = {ALLOC_VAR: "max_split_size_mb:512,garbage_collection_threshold:0.7"}
    cfg = _cfg({CUDA_VAR: "garbage_collection_threshold:0.6," + ES})
    result = configure_bridge_env(cfg, environ=shell, torch_version=NEW)
    assert codes(result.findings) == ["max_split_size", "carried"]
    merged = AllocConf.parse(cfg.env_vars[CUDA_VAR])
    assert merged.get("max_split_size_mb") == "512" and merged.get("garbage_collection_threshold") == "0.7"
    reads = AllocConf.parse(_torch_reads(_bridge_applies(cfg, shell))["reads"])
    assert (reads.get("max_split_size_mb"), reads.get("garbage_collection_threshold")) == ("512", "0.7")
    assert reads.flag("expandable_segments") is True


def test_an_explicit_false_in_a_variable_torch_ignores_is_still_respected():
    env = {CUDA_VAR: "max_split_size_mb:256", ALLOC_VAR: "expandable_segments:False"}
    child = _child(env)  # init() in a fresh interpreter
    assert child["env"] == env  # nothing turned on against the user's explicit False
    assert [f["code"] for f in child["result"]["findings"]] == ["shadowed", "user_disabled"]


def test_torch_that_already_read_its_settings_gets_them_through_its_real_setter():
    """No mocks: torch has read PYTORCH_ALLOC_CONF (getter called), then the setup changes it."""
    code = """
import json, os, torch
before = torch._C._accelerator_getAllocatorSettings()  # torch parses the variable now
from megatron_bridge_ext.levers.allocator import setup_allocator
result = setup_allocator()
print(json.dumps({"before": before, "after": torch._C._accelerator_getAllocatorSettings(),
                  "applied": result.applied, "codes": [f.code for f in result.findings]}))
"""
    env = {k: v for k, v in os.environ.items() if k not in (CUDA_VAR, ALLOC_VAR, "MBX_ALLOCATOR_IPC")}
    env[ALLOC_VAR] = "max_split_size_mb:64"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["before"] == "max_split_size_mb:64"
    assert AllocConf.parse(child["after"]).flag("expandable_segments") is True
    assert child["applied"] == "runtime" and "runtime" in child["codes"]
