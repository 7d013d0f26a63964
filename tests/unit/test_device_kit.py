"""The device kit's pinned wheel list agrees with the tested Bridge pair, and the check's verdict arithmetic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

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
    device_check = _device_check()
    shape = {"seq": 8192, "micro_batch": 1, "hidden": 4096, "tp": 2, "dtype": "bfloat16"}
    assert device_check._adapter_bytes(shape) == 8192 * 4096 * 2 // 2  # 32 MiB: the Qwen3-8B-shaped stack
    assert device_check._adapter_bytes(dict(shape, tp=4, dtype="float32")) == 8192 * 4096 * 4 * 3 // 4


def _device_check():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    check = _device_check()
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
    check = _device_check()
    base, row = _rows(0, 0)
    row["saved_activation_bytes"] = base["saved_activation_bytes"] - 2 * LAYERS * WORTH
    status, detail = check.judge(base, row, LAYERS, cuda=False)
    assert status == check.DRY
    assert "compute only: collectives are free on a fake group" in detail and "x1.040" in detail
    row["saved_activation_bytes"] += 512
    assert check.judge(base, row, LAYERS, cuda=False)[0] == check.FAIL


def test_failed_and_not_run_checks_make_the_exit_status_non_zero(tmp_path):
    check = _device_check()
    report = check.Check(tmp_path, dry_run=False)
    report.verdict("a", check.PASS, "")
    report.verdict("b", check.NA, "")
    assert report.failed() == []
    report.verdict("c", check.NOT_RUN, "")
    assert [v["check"] for v in report.failed()] == ["c"]
    assert json.loads((tmp_path / "device_check.json").read_text())["verdicts"][-1]["status"] == check.NOT_RUN


def test_the_fragmentation_geometry_is_diagnosed_as_fragmentation():
    spec = importlib.util.spec_from_file_location("workload", ROOT / "scripts" / "fragmentation_workload.py")
    workload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    stats = workload.stats_at_the_oom()
    assert stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"] == workload.BIG // 2
    diagnosis = classify(stats, total_memory=workload.BIG + workload.HEADROOM, expandable_segments=False,
                         request_bytes=stats["request_bytes"])
    assert diagnosis.kind == "fragmentation"


def test_the_estimate_verdict_fails_an_estimate_off_target_or_missing():
    check = _device_check()
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
    spec = importlib.util.spec_from_file_location("peak_memory", ROOT / "scripts" / "peak_memory.py")
    peak_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peak_memory)
    committed = json.loads((ROOT / "scripts" / "device_estimates.json").read_text())
    layers = {int(key.split("/")[1].removeprefix("layers=")) for key in committed}
    assert layers == {_device_check().DEFAULT_LAYERS}
    fresh = peak_memory.write_estimates(str(tmp_path / "estimates.json"), layers.pop())
    assert fresh == committed, "scripts/device_estimates.json is stale: python scripts/peak_memory.py " \
                               "--write-estimates scripts/device_estimates.json --layers 4"


def _peak_memory():
    spec = importlib.util.spec_from_file_location("peak_memory", ROOT / "scripts" / "peak_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, named", [
    (["--budget", "10"], "--budget=10"),
    (["--layers", "0"], "--layers=0"),
])
def test_device_check_refuses_bad_options_before_any_part(argv, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        _device_check().main(argv + ["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "device_check.json").exists()


@pytest.mark.parametrize("argv, named", [
    (["--variant", "baseline", "--steps", "3"], "--steps=3"),
    (["--variant", "baseline", "--estimates", "/nonexistent/estimates.json"], "--estimates /nonexistent"),
    (["--variant", "baseline", "--estimate", "--estimates", "scripts/device_estimates.json"], "choose one"),
    (["--layers", "2"], "--variant is required"),
])
def test_peak_memory_refuses_bad_options_in_one_line(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        _peak_memory().main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_a_committed_estimate_missing_for_the_layers_says_how_to_write_it():
    found = _peak_memory().committed_estimate(str(ROOT / "scripts" / "device_estimates.json"), "baseline", 7, False)
    assert "no estimate for qwen3-8b/layers=7/baseline" in found["error"]
    assert "--write-estimates" in found["error"]
