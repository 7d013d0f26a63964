"""The allocator setup plan: which variable is written, and the user's options surviving every path (CPU only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_bridge_ext.levers.allocator import ALLOC_VAR, CUDA_VAR, configure_bridge_env, setup_allocator
from megatron_bridge_ext.findings import Refused
from megatron_bridge_ext.levers.allocator.options import AllocConf
from tests.support.allocator import ES, NEW, ROOT, _bridge_applies, _cfg, _child, codes, plan

pytestmark = pytest.mark.unit

OLD = "2.10.0"  # readers disagree: every set variable is written
ANCIENT = "2.7.1"  # only PYTORCH_CUDA_ALLOC_CONF


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


def test_carrying_the_shells_options_keeps_the_recipes_own_and_adds_ours():
    """Three sources, each with a key of its own: the recipe's max_split_size_mb, the shell's
    roundup_power2_divisions, our expandable_segments. On the key both set (garbage_collection_threshold)
    the shell wins, as it would in the shell variable the recipe's hides."""
    shell = {ALLOC_VAR: "garbage_collection_threshold:0.7,roundup_power2_divisions:4"}
    cfg = _cfg({CUDA_VAR: "max_split_size_mb:256,garbage_collection_threshold:0.6"})
    result = configure_bridge_env(cfg, environ=shell, torch_version=NEW)
    assert codes(result.findings) == ["max_split_size", "carried"]
    want = {"max_split_size_mb": "256", "garbage_collection_threshold": "0.7", "roundup_power2_divisions": "4",
            "expandable_segments": "True"}
    written = AllocConf.parse(cfg.env_vars[CUDA_VAR])
    assert {key: written.get(key) for key in written.keys()} == want
    reads = AllocConf.parse(_torch_reads(_bridge_applies(cfg, shell))["reads"])
    assert {key: reads.get(key) for key in want} == want


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
