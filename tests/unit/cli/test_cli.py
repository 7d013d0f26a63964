"""The `mbx` entry point: `mbx diagnose`, `mbx run`, `--version`, and bad input to every subcommand: one line on
stderr naming the setting and the fix, a non-zero exit, no traceback, and (demo/bench) no rank started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge_ext.cli import main
from tests.support.cli import ALLOC, CUDA, ROOT, _one_clean_line, mbx

pytestmark = pytest.mark.unit

DATA = ROOT / "tests" / "data"


@pytest.mark.parametrize("name, kind", [("memory_stats_fragmentation.json", "fragmentation"),
                                        ("memory_stats_capacity.json", "capacity")])
def test_diagnose_first_line_starts_with_the_class(name, kind, capsys):
    assert main(["diagnose", str(DATA / name)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(kind + ":")
    assert main(["diagnose", str(DATA / name), "--json", "--total-memory", "80GiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == kind and data["metrics"]["total_memory"] == 80 << 30


def test_shipped_stats_use_torch_key_names():
    from tests.support.memstats import capacity_stats, fragmentation_stats

    assert json.loads((DATA / "memory_stats_fragmentation.json").read_text()) == fragmentation_stats()
    assert json.loads((DATA / "memory_stats_capacity.json").read_text()) == capacity_stats()


def test_diagnose_bad_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert main(["diagnose", str(bad)]) == 2
    assert "expected a JSON object" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path / "missing.json")]) == 2


def _mbx(args, env_overrides=None):
    env = {k: v for k, v in os.environ.items() if k not in (ALLOC, CUDA, "MBX_ALLOCATOR_IPC", "NCCL_GRAPH_REGISTER")}
    env.update(env_overrides or {})
    return subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", *args], env=env, capture_output=True,
                          text=True, cwd=ROOT)


_PRINT_ENV = ("import json, os, sys; print(json.dumps({'alloc': os.environ.get('PYTORCH_ALLOC_CONF'), "
              "'cuda': os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), 'argv': sys.argv[1:]})); sys.exit(int(sys.argv[1]))")


def test_run_sets_the_variable_for_the_child_and_passes_everything_through():
    out = _mbx(["run", "--", sys.executable, "-c", _PRINT_ENV, "3", "--nproc_per_node=8", "a b", "--"])
    assert out.returncode == 3, out.stderr
    child = json.loads(out.stdout)
    assert child == {"alloc": "expandable_segments:True", "cuda": None, "argv": ["3", "--nproc_per_node=8", "a b", "--"]}
    assert "PYTORCH_ALLOC_CONF: unset -> 'expandable_segments:True'" in out.stderr


def test_run_keeps_the_users_options():
    out = _mbx(["run", "--", sys.executable, "-c", _PRINT_ENV, "0"], {CUDA: "garbage_collection_threshold:0.6"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cuda"] == "garbage_collection_threshold:0.6,expandable_segments:True"


def test_run_refuses_before_starting_the_command():
    out = _mbx(["run", "--cuda-graph-impl", "local", "--", sys.executable, "-c", "print('started')"],
               {"NCCL_GRAPH_REGISTER": "1"})
    assert out.returncode == 2 and "started" not in out.stdout
    assert "NCCL_GRAPH_REGISTER" in out.stderr and "Fix:" in out.stderr


def test_run_without_command_or_unknown_command():
    assert _mbx(["run"]).returncode == 2
    missing = _mbx(["run", "--", "no-such-command-mbx"])
    assert missing.returncode == 127 and "command not found" in missing.stderr


_PRINT_HOOKS = ("import json, os, sys; from megatron_bridge_ext.patches import bridge_lora_te_norm_grad as te; "
                "print(json.dumps({'check': te.check_installed(), 'user': os.environ.get('MBX_TEST_USER_SITE'), "
                "'path': os.environ.get('PYTHONPATH'), "
                "'upstream': sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'megatron'))}))")


@pytest.fixture
def user_site(tmp_path):
    """A folder with the user's own sitecustomize.py, which marks the environment when it runs."""
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['MBX_TEST_USER_SITE'] = 'ran'\n")
    return os.pathsep.join([str(tmp_path), str(ROOT)])


def test_run_gives_the_commands_python_the_init_hooks_and_keeps_the_users_sitecustomize(user_site):
    from megatron_bridge_ext import run_site

    plain = subprocess.run([sys.executable, "-c", _PRINT_HOOKS], env=dict(os.environ, PYTHONPATH=user_site),
                           capture_output=True, text=True, cwd=ROOT)
    out = _mbx(["run", "--", sys.executable, "-c", _PRINT_HOOKS], {"PYTHONPATH": user_site})
    assert out.returncode == 0 and plain.returncode == 0, out.stderr + plain.stderr
    assert json.loads(plain.stdout) == {"check": False, "user": "ran", "path": user_site, "upstream": []}
    assert json.loads(out.stdout) == {"check": True, "user": "ran", "path": run_site.FOLDER + os.pathsep + user_site,
                                      "upstream": []}
    assert f"PYTHONPATH: {run_site.FOLDER} put first (your entries kept after it)" in out.stderr


def test_run_leaves_pythonpath_alone_when_the_user_turned_the_hooks_off(user_site):
    out = _mbx(["run", "--", sys.executable, "-c", _PRINT_HOOKS], {"PYTHONPATH": user_site, "MBX_RUN_INIT": "0"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"check": False, "user": "ran", "path": user_site, "upstream": []}
    assert "MBX_RUN_INIT='0': PYTHONPATH left as it is" in out.stderr


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
    # A negative value as its own word reaches the option's check, not argparse's "expected one argument".
    _one_clean_line(mbx("diagnose", good, "--total-memory", "-5GiB"), "--total-memory: '-5GiB' is not a positive size")


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
