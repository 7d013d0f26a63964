"""Applying the allocator setup: to this process, at run time, by init() before CUDA, and to a Bridge config's env_vars (CPU only)."""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_bridge_ext.levers import allocator
from megatron_bridge_ext.levers.allocator import (
    runtime as allocator_runtime,
    ALLOC_VAR,
    CUDA_VAR,
    configure_bridge_env,
    setup_allocator,
)
from megatron_bridge_ext.findings import Refused
from tests.support.allocator import ES, NEW, ROOT, _bridge_applies, _cfg, _child

pytestmark = pytest.mark.unit


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
