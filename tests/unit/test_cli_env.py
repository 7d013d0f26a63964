"""`mbx env`, `mbx diagnose` and `mbx run`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge_ext.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
ALLOC, CUDA = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"


def requirements_pins() -> dict[str, set[str]]:
    """Every version the repository's requirements pin per distribution (an independent source)."""
    pins: dict[str, set[str]] = {}
    for path in (ROOT / "requirements").glob("*.txt"):
        for line in path.read_text().splitlines():
            name, sep, version = line.split("#")[0].strip().partition("==")
            if sep:
                pins.setdefault(name, set()).add(version)
    return pins


@pytest.fixture
def clean_env(monkeypatch):
    for name in (ALLOC, CUDA, "MBX_ALLOCATOR_IPC", "NCCL_GRAPH_REGISTER"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_env_json_reports_versions_settings_and_findings(clean_env, capsys):
    clean_env.setenv(CUDA, "max_split_size_mb:512")
    assert main(["env", "--json", "--cuda-graph-impl", "local"]) == 0
    report = json.loads(capsys.readouterr().out)
    import torch
    from megatron.core import package_info
    from packaging.version import Version

    # the report reads package metadata; the imported modules say their own versions
    assert report["versions"]["torch"] == Version(torch.__version__).base_version
    assert report["versions"]["megatron-core"] == Version(package_info.__version__).base_version
    assert report["versions"]["transformer-engine"] is None  # not installed here
    assert report["versions"]["megatron-bridge"] in requirements_pins()["megatron-bridge"]
    assert report["effective"] == {"variable": CUDA, "value": "max_split_size_mb:512", "expandable_segments": False}
    assert report["setup_would_change"] == {
        CUDA: {"old": "max_split_size_mb:512", "new": "max_split_size_mb:512,expandable_segments:True"},
        "NCCL_GRAPH_REGISTER": {"old": None, "new": "0"}}
    assert {f["code"] for f in report["findings"]} == {"max_split_size", "cuda_graphs"}
    assert os.environ[CUDA] == "max_split_size_mb:512"  # mbx env changes nothing


def test_env_text_and_error_exit(clean_env, capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch reads: PYTORCH_CUDA_ALLOC_CONF if set" in out and "PYTORCH_ALLOC_CONF='expandable_segments:True'" in out
    clean_env.setenv("NCCL_GRAPH_REGISTER", "1")
    assert main(["env", "--cuda-graph-impl", "local"]) == 1
    assert "[error] NCCL_GRAPH_REGISTER" in capsys.readouterr().out
    clean_env.setenv(ALLOC, "expandable_segments:yes")
    assert main(["env"]) == 1
    assert "expandable_segments:yes" in capsys.readouterr().out


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


def test_patches_lists_every_patch_in_a_narrow_table_and_says_this_process_is_unpatched():
    from megatron_bridge_ext.patches import PATCHES

    done = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", "patches"], cwd=ROOT, text=True,
                          capture_output=True, timeout=600, env=dict(os.environ, MBX_LOG_LEVEL="WARNING"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:2 + len(PATCHES)]] == [p.name for p in PATCHES]
    assert max(len(line) for line in lines[:2 + len(PATCHES)]) <= 120
    assert "this process: nothing applied" in done.stdout
    verbose = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", "patches", "--verbose"], cwd=ROOT,
                             text=True, capture_output=True, timeout=600, env=dict(os.environ, MBX_LOG_LEVEL="WARNING"))
    assert verbose.returncode == 0 and max(len(line) for line in verbose.stdout.splitlines()) <= 120
    for patch in PATCHES:
        assert f"\n{patch.name}\n" in verbose.stdout
    assert verbose.stdout.count("applied by:") == len(PATCHES)
    te_section = verbose.stdout.split("\nbridge_lora_te_norm_grad\n")[1].split("\n\n")[0]
    assert "megatron_bridge_ext.init() and `mbx run`" in " ".join(te_section.split())


def test_env_verify_on_cpu_applies_the_setup_and_says_it_could_not_verify_on_a_device(clean_env, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU path")
    assert main(["env", "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verify"]["on_device"] is False and report["verify"]["configured"] is True
    assert "not verified on a device" in report["verify"]["message"]
    assert os.environ[ALLOC] == "expandable_segments:True"  # --verify applies the setup to this process
