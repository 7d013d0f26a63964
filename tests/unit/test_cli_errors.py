"""Bad input to every `mbx` subcommand: one line on stderr naming the setting and the fix, a non-zero exit,
no traceback, and (demo/bench) no rank started."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def mbx(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    return subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", *args], cwd=cwd, text=True,
                          capture_output=True, env={**base, **(env or {})}, timeout=600)


def _one_clean_line(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """The last stderr line carries the message; nothing looks like a traceback; the exit status is not 0."""
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in line, (fragment, done.stderr)
    return line


@pytest.mark.parametrize("command", [["demo"], ["bench", "memory"]], ids=["demo", "bench"])
@pytest.mark.parametrize("args, fragments", [
    (["--tp", "3"], ["is not divisible by --tp=3"]),
    (["--heads", "3"], ["--hidden=", "--heads=3"]),
    (["--layers", "0"], ["--layers", "must be at least 1"]),
    (["--steps", "0"], ["--steps", "must be at least 1"]),
    (["--steps", "-1"], ["--steps"]),
    (["--variants", "bogus"], ["--variants", "bogus", "choose from"]),
    (["--nproc", "2"], ["unrecognized arguments: --nproc"]),
], ids=["tp3", "heads3", "layers0", "steps0", "steps-1", "variant", "nproc"])
def test_demo_and_bench_refuse_bad_options_before_any_rank_starts(command, args, fragments):
    done = mbx(*command, *args)
    _one_clean_line(done, *fragments)
    assert done.returncode == 2
    assert "starting" not in done.stderr  # the launcher never ran


def _stats() -> dict:
    return json.loads((DATA / "memory_stats_fragmentation.json").read_text())


RESERVED = "reserved_bytes.all.current"
ALLOCATED = "allocated_bytes.all.current"


@pytest.mark.parametrize("key, value", [(RESERVED, None), (RESERVED, [1]), (RESERVED, "80GiB"),
                                        (RESERVED, float("inf")), (RESERVED, 1.5), (ALLOCATED, -1),
                                        ("num_alloc_retries", -2), ("inactive_split_bytes.all.current", True)])
def test_diagnose_names_the_file_and_the_key_of_a_bad_value(tmp_path, key, value):
    stats = _stats()
    stats[key] = value
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(stats))  # Infinity is valid JSON for Python's reader
    _one_clean_line(mbx("diagnose", str(path)), str(path), key)


def _report(tmp_path, **fields) -> Path:
    report = {"format": "megatron_bridge_ext.oom_report/1", "stats": _stats(), "allocator": {}}
    report.update(fields)
    path = tmp_path / "oom_rank0.json"
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("fields, fragment", [
    ({"allocator": "expandable_segments:True"}, "allocator is"),
    ({"allocator": {"expandable_segments": "true"}}, "allocator.expandable_segments"),
    ({"request_bytes": "2GiB"}, "request_bytes"),
    ({"total_memory": "80GiB"}, "total memory"),
])
def test_diagnose_refuses_malformed_oom_reports(tmp_path, fields, fragment):
    _one_clean_line(mbx("diagnose", str(_report(tmp_path, **fields))), "oom_rank0.json", fragment)


def test_diagnose_refuses_impossible_numbers(tmp_path):
    stats = _stats()
    stats[ALLOCATED] = stats[RESERVED] + 1
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(stats))
    _one_clean_line(mbx("diagnose", str(path)), "is larger than " + RESERVED)
    good = str(DATA / "memory_stats_fragmentation.json")
    _one_clean_line(mbx("diagnose", good, "--total-memory", "1GiB"), "less than the", "reserved")
    _one_clean_line(mbx("diagnose", good, "--total-memory", "0GiB"), "--total-memory", "not a positive size")
    _one_clean_line(mbx("diagnose", good, "--total-memory", "1.2.3GiB"), "--total-memory", "not a size")


def test_a_request_larger_than_all_free_memory_is_not_fragmentation(tmp_path):
    path = _report(tmp_path, request_bytes=200 * 2**30, total_memory=80 * 2**30)
    done = mbx("diagnose", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("capacity:")
    assert "larger than all free memory together" in done.stdout


def test_fragmentation_with_expandable_segments_on_does_not_advise_turning_them_on():
    done = mbx("diagnose", str(DATA / "memory_stats_fragmentation.json"), "--expandable-segments", "on")
    assert done.returncode == 0, done.stderr
    head = done.stdout.split("decision order:")[0]  # the list after it names every lever, step 1 included
    assert "turn on expandable segments" not in head and "(step 1)" not in head
    assert "expandable segments are on already" in head


def test_env_refuses_an_unknown_cuda_graph_impl():
    _one_clean_line(mbx("env", "--cuda-graph-impl", "bogus"), "--cuda-graph-impl", "invalid choice")


@pytest.mark.parametrize("value, fragment", [("max_split_size_mb:abc", "torch reads a number here"),
                                             ("my_key:1", "Unrecognized key")])
def test_run_refuses_bad_allocator_options_before_launching(value, fragment):
    done = mbx("run", "--", sys.executable, "-c", "print('launched')", env={"PYTORCH_ALLOC_CONF": value})
    assert "launched" not in done.stdout
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert fragment in done.stderr and "Fix:" in done.stderr


def test_a_bad_log_level_is_one_line():
    _one_clean_line(mbx("env", env={"MBX_LOG_LEVEL": "garbage"}), "MBX_LOG_LEVEL='garbage'", "Fix:")


def test_run_with_an_unknown_option_prints_the_usage_of_run():
    done = mbx("run", "--bogus", "--", "true")
    assert done.returncode == 2 and "usage: mbx run" in done.stderr and "--bogus" in done.stderr


def test_version():
    from megatron_bridge_ext import __version__

    done = mbx("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"megatron-bridge-ext {__version__}"


@pytest.mark.parametrize("message, text", [
    ("TP=3 does not divide the 32 attention heads", "s: TP=3 does not divide the 32 attention heads. Fix: f"),
    ("ends a sentence.", "s: ends a sentence. Fix: f"),
])
def test_a_finding_puts_a_full_stop_before_its_fix(message, text):
    from megatron_bridge_ext.findings import ERROR, Finding

    assert Finding("c", ERROR, "s", message, "f").text() == text
    assert Finding("c", ERROR, "s", message).text() == f"s: {message}"


@pytest.mark.parametrize("override", ["model.num_layerz=32", "+model.num_layerz=32"])
def test_plan_names_a_misspelt_override_field_and_the_closest_one(override):
    done = mbx("plan", "--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config",
               "--gpu-memory", "80GB", override)
    line = _one_clean_line(done, "model.num_layerz: no such field of GPTModelProvider.",
                           "Fix: did you mean model.num_layers?")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == line  # the one line, nothing logged around it


SHAPE_KEYS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
              "num_attention_heads": "num_attention_heads", "intermediate_size": "ffn_hidden_size",
              "vocab_size": "vocab_size", "num_key_value_heads": "num_query_groups", "head_dim": "kv_channels"}


@pytest.mark.parametrize("key, value", [(key, 0) for key in SHAPE_KEYS]
                         + [("hidden_size", -4096), ("num_attention_heads", 32.5)])
def test_plan_refuses_a_config_json_shape_below_one_before_any_build(tmp_path, key, value):
    """Zero heads made Megatron Core divide by zero while the model was built; every shape field of
    config.json is checked with the arguments, naming the file's key and the override that sets it."""
    data = json.loads((DATA / "qwen3-8b" / "config.json").read_text())
    data[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    done = mbx("plan", "--hf-config", str(path), "--seq", "256", "--gpu-memory", "80GiB")
    _one_clean_line(done, f"--hf-config {path}: {key} is {value!r}.",
                    f"Fix: set {key} to a whole number of 1 or more in the file, or override model.{SHAPE_KEYS[key]}")
    assert done.returncode == 2 and done.stdout == ""


def test_plan_refuses_zero_heads_from_an_override_of_a_recipe():
    done = mbx("plan", "--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config",
               "--gpu-memory", "80GiB", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=0",
               "model.ffn_hidden_size=128", "model.vocab_size=1024")
    _one_clean_line(done, "model.num_attention_heads: is 0. Fix: set it to a whole number of 1 or more")
    assert done.returncode == 2 and done.stdout == ""
