"""The device kit's pinned wheel list agrees with the tested Bridge pair, and the check's verdict arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge_ext.device_check import check
from megatron_bridge_ext.device_check import fragmentation_workload as workload
from megatron_bridge_ext.device_check import peak_memory, wheels
from megatron_bridge_ext.diagnose import classify

ROOT = Path(__file__).resolve().parents[2]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        package, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[package.lower().replace("_", "-")] = version
    return pins


def test_the_carried_megatron_pair_is_the_tested_one():
    device, bridge = _pins("device.txt"), _pins("bridge-0.6.2.txt")
    for package in ("megatron-core", "megatron-bridge", "transformers"):
        assert device[package] == bridge[package], package
    common = _pins("common.txt")
    for package in ("numpy", "einops", "pyyaml", "packaging", "omegaconf", "safetensors", "tqdm", "rich", "pytest",
                    "hypothesis"):
        assert device[package] == common[package], package


def test_the_adapter_worth_is_the_gathered_input_minus_the_shard():
    shape = {"seq": 8192, "micro_batch": 1, "hidden": 4096, "tp": 2, "dtype": "bfloat16"}
    assert check._adapter_bytes(shape) == 8192 * 4096 * 2 // 2  # 32 MiB: the Qwen3-8B-shaped stack
    assert check._adapter_bytes(dict(shape, tp=4, dtype="float32")) == 8192 * 4096 * 4 * 3 // 4


LAYERS = 4
SHAPE = {"seq": 8192, "micro_batch": 1, "hidden": 4096, "tp": 2, "dtype": "bfloat16"}
WORTH = 8192 * 4096 * 2 // 2


def _rows(forward_drop: int, peak_drop: int, buffer: int = 0) -> tuple[dict, dict]:
    """A baseline row and a variant row whose figures differ by the given drops (buffer included)."""
    base = {"shape": SHAPE, "memory_after_forward": 50 << 30, "peak_forward_backward": 70 << 30,
            "regather_buffer_bytes": 0, "step_time_ms": 100.0, "collective_bytes_per_step": 10,
            "saved_activation_bytes": 9 << 30}
    row = dict(base, memory_after_forward=base["memory_after_forward"] - forward_drop + buffer,
               peak_forward_backward=base["peak_forward_backward"] - peak_drop + buffer, regather_buffer_bytes=buffer,
               step_time_ms=104.0)
    return base, row


def test_the_peak_verdict_passes_what_the_peak_holds_and_fails_the_rest():
    adapters = 2 * LAYERS
    passing = [
        (adapters * WORTH, adapters * WORTH, 0),  # the peak while every retained input is alive
        (adapters * WORTH, (adapters - 1) * WORTH, 0),  # the peak in the last layer's backward
        (adapters * WORTH, adapters * WORTH, 8192 * 4096 * 2),  # regather: its gather buffer counted apart
    ]
    failing = [
        ((adapters - 1) * WORTH, adapters * WORTH, 0),  # after forward, one adapter's input still retained
        (adapters * WORTH, (adapters - 2) * WORTH, 0),  # the peak holds two adapters' worth too much
        (adapters * WORTH, (adapters + 1) * WORTH, 0),  # more saved than the adapters hold: something else moved
        (adapters * WORTH + (2 << 20), adapters * WORTH, 0),  # 2 MiB over the allowance
    ]
    for drops in passing:
        assert check.judge(*_rows(*drops), LAYERS, cuda=True)[0] == check.PASS, drops
    for drops in failing:
        assert check.judge(*_rows(*drops), LAYERS, cuda=True)[0] == check.FAIL, drops


def test_the_dry_verdict_wants_the_exact_saved_bytes_and_labels_timing_compute_only():
    base, row = _rows(0, 0)
    row["saved_activation_bytes"] = base["saved_activation_bytes"] - 2 * LAYERS * WORTH
    status, detail = check.judge(base, row, LAYERS, cuda=False)
    assert status == check.DRY
    assert "compute only: collectives are free on a fake group" in detail and "x1.040" in detail
    row["saved_activation_bytes"] += 512
    assert check.judge(base, row, LAYERS, cuda=False)[0] == check.FAIL


def test_failed_and_not_run_checks_make_the_exit_status_non_zero(tmp_path):
    report = check.Check(tmp_path, dry_run=False)
    report.verdict("a", check.PASS, "")
    report.verdict("b", check.NA, "")
    assert report.failed() == []
    report.verdict("c", check.NOT_RUN, "")
    assert [v["check"] for v in report.failed()] == ["c"]
    assert json.loads((tmp_path / "device_check.json").read_text())["verdicts"][-1]["status"] == check.NOT_RUN


def test_the_fragmentation_geometry_is_diagnosed_as_fragmentation():
    stats = workload.stats_at_the_oom()
    assert stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"] == workload.BIG // 2
    diagnosis = classify(stats, total_memory=workload.BIG + workload.HEADROOM, expandable_segments=False,
                         request_bytes=stats["request_bytes"])
    assert diagnosis.kind == "fragmentation"


def test_the_estimate_verdict_fails_an_estimate_off_target_or_missing():
    peak = 40 << 30

    def row(error=None, within=True, relative=0.02):
        estimate = {"error": error} if error else {"compared_bytes": int(peak * (1 + relative)), "relative_error": relative,
                                                   "within_target": within, "target": 0.05, "peak_bytes": peak,
                                                   "excluded": ["optimizer states"]}
        return {"peak_forward_backward": peak, "estimate": estimate}

    assert check.judge_estimate({"baseline": row(), "shard_local": row(relative=-0.04)}, cuda=True)[0] == check.PASS
    status, detail = check.judge_estimate({"baseline": row(), "shard_local": row(within=False, relative=0.09)}, cuda=True)
    assert status == check.FAIL and "shard_local: +9.0%" in detail
    status, detail = check.judge_estimate({"baseline": row(error="ImportError: no module"), "regather": row()},
                                          cuda=False)
    assert status == check.FAIL and "ImportError" in detail
    assert check.judge_estimate({"baseline": {"peak_forward_backward": None}}, cuda=False)[0] == check.FAIL
    assert check.judge_estimate({"baseline": row()}, cuda=False)[0] == check.DRY


def test_the_carried_estimates_are_the_estimates_of_the_measured_configs(tmp_path):
    committed = json.loads(Path(check.ESTIMATES).read_text())
    layers = {int(key.split("/")[1].removeprefix("layers=")) for key in committed}
    assert layers == {check.DEFAULT_LAYERS}
    fresh = peak_memory.write_estimates(str(tmp_path / "estimates.json"), layers.pop())
    assert fresh == committed, f"{check.ESTIMATES} is stale: python -m megatron_bridge_ext.device_check." \
                               f"peak_memory --write-estimates {check.ESTIMATES} --layers 4"


@pytest.mark.parametrize("argv, named", [
    (["--budget", "10"], "--budget=10"),
    (["--layers", "0"], "--layers=0"),
])
def test_device_check_refuses_bad_options_before_any_part(argv, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        check.main(argv + ["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "device_check.json").exists()


@pytest.mark.parametrize("argv, named", [
    (["--variant", "baseline", "--steps", "3"], "--steps=3"),
    (["--variant", "baseline", "--estimates", "/nonexistent/estimates.json"], "--estimates /nonexistent"),
    (["--variant", "baseline", "--estimate", "--estimates", check.ESTIMATES], "choose one"),
    (["--layers", "2"], "--variant is required"),
])
def test_peak_memory_refuses_bad_options_in_one_line(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        peak_memory.main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_a_committed_estimate_missing_for_the_layers_says_how_to_write_it():
    found = peak_memory.committed_estimate(check.ESTIMATES, "baseline", 7, False)
    assert "no estimate for qwen3-8b/layers=7/baseline" in found["error"]
    assert "--write-estimates" in found["error"]


def test_the_device_check_package_imports_neither_torch_nor_megatron():
    """The GPU machine has no Megatron until the carried wheels are installed by the package's own __main__."""
    code = ("import pkgutil, importlib, sys, megatron_bridge_ext.device_check as kit\n"
            "names = [m.name for m in pkgutil.iter_modules(kit.__path__)]\n"
            "for name in names: importlib.import_module(f'megatron_bridge_ext.device_check.{name}')\n"
            "print(sorted(names)); print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    names, heavy = done.stdout.splitlines()
    assert "'__main__'" in names and "'check'" in names and "'peak_memory'" in names
    assert heavy == "[]"


def test_the_device_kit_runs_its_parts_as_modules_without_editing_sys_path():
    files = [*(ROOT / "scripts").iterdir(), *(ROOT / "megatron_bridge_ext" / "device_check").glob("*.py")]
    assert [f.name for f in files if "sys.path" in f.read_text()] == []
    for shell in ("device_check.sh", "device_wheels.sh", "device_rehearsal.sh"):
        assert "-m megatron_bridge_ext.device_check" in (ROOT / "scripts" / shell).read_text(), shell


def _device_command(tmp_path, *argv) -> subprocess.CompletedProcess:
    """``python -m megatron_bridge_ext.device_check`` with one carried 'wheel' that is not a wheel."""
    (tmp_path / "whl").mkdir()
    (tmp_path / "whl" / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    env = dict(os.environ, PYTHONPATH=str(ROOT), MBX_WHEELS=str(tmp_path / "whl"),
               MBX_DEVICE_SITE=str(tmp_path / "site"), OUT=str(tmp_path / "out"))
    return subprocess.run([sys.executable, "-m", "megatron_bridge_ext.device_check", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)


def test_the_device_command_refuses_a_bad_option_before_installing_anything(tmp_path):
    done = _device_command(tmp_path, "--layers", "0")
    assert done.returncode == 2
    assert "--layers=0" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "site").exists() and not (tmp_path / "out").exists()


def test_a_carried_wheel_that_does_not_install_stops_the_check_with_the_fix(tmp_path):
    done = _device_command(tmp_path, "--dry-run")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith("device_check: installing the carried wheels from ")
    assert "Fix: rebuild them with scripts/device_wheels.sh" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_wheel_list_is_the_pinned_lines_without_comments():
    pinned = wheels.pins(ROOT / "requirements" / "device.txt")
    assert {pin.split("==")[0].lower().replace("_", "-") for pin in pinned} == set(_pins("device.txt"))
    assert f"{wheels.SDIST_ONLY}=={_pins('device.txt')[wheels.SDIST_ONLY]}" in pinned


def test_the_one_command_runs_the_module_from_the_repository_root_wherever_it_is_started(tmp_path):
    """scripts/device_check.sh from another folder, no PYTHONPATH: it reaches the module's option check."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, MBX_WHEELS=str(tmp_path / "none"), OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--layers", "0"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 2
    assert "usage: python -m megatron_bridge_ext.device_check" in done.stderr and "--layers=0" in done.stderr
