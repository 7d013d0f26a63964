"""The device check's verdict arithmetic, its exit status and its option checks."""

from __future__ import annotations

import json
import pickle

import pytest

from megatron_bridge_ext.device_check import check


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


def _snapshot_file(tmp_path, edit=None):
    """The workload's geometry snapshot (fragmentation_workload.snapshot_at_the_oom), optionally edited."""
    from megatron_bridge_ext.device_check import fragmentation_workload as workload

    data = workload.snapshot_at_the_oom()
    if edit:
        edit(data, workload)
    path = tmp_path / "fragmentation_snapshot.pickle"
    path.write_bytes(pickle.dumps(data))
    return path


def _request_all_of_it(data, workload):
    data["device_traces"][0][0].update(size=2 * workload.BIG, device_free=0)


def _merge_two_holes(data, workload):
    blocks = data["segments"][0]["blocks"]
    blocks[2]["size"] += blocks[3]["size"] + blocks[4]["size"]  # one free block of 3 pieces: the request fits it
    del blocks[3:5]


def test_the_snapshot_verdict_passes_fragmentation_shown_with_the_workloads_figures(tmp_path):
    status, detail = check.judge_snapshot(_snapshot_file(tmp_path), check.DRY)
    assert status == check.DRY and detail.startswith("fragmentation shown: ")


def _ask_three_pieces(data, workload):
    data["device_traces"][0][0]["size"] = 3 * workload.PIECE  # still fragmentation, not the workload's request


@pytest.mark.parametrize("edit, said", [
    (_request_all_of_it, "capacity ruled out"),
    (_merge_two_holes, "unknown undecided"),
    (_ask_three_pieces, "fragmentation shown"),
])
def test_the_snapshot_verdict_fails_another_verdict_or_geometry(tmp_path, edit, said):
    status, detail = check.judge_snapshot(_snapshot_file(tmp_path, edit), check.PASS)
    assert status == check.FAIL and detail.startswith(said)


def test_the_snapshot_verdict_fails_a_missing_or_unreadable_snapshot(tmp_path):
    assert check.judge_snapshot(tmp_path / "none.pickle", check.PASS) == (check.FAIL, f"no snapshot at {tmp_path}/none.pickle")
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04")
    status, detail = check.judge_snapshot(bad, check.PASS)
    assert status == check.FAIL and detail.startswith(f"{bad}: ")


def _message_file(tmp_path, **figures):
    """The OOM message torch prints for the workload's geometry: 1 GiB reserved, half free in 32 MiB holes, a
    64 MiB request under a memory-fraction cap (tests/support/oom_logs.allocator_oom)."""
    from megatron_bridge_ext.device_check import fragmentation_workload as workload
    from tests.support.oom_logs import allocator_oom

    values = dict(total=80 << 30, free=79 << 30, allocated=workload.BIG // 2, reserved=workload.BIG,
                  allowed=workload.BIG + workload.HEADROOM) | figures
    path = tmp_path / workload.MESSAGE
    path.write_text(allocator_oom(2 * workload.PIECE, **values) + "\n")
    return path


def test_mbx_diagnose_itself_calls_the_message_and_the_snapshot_fragmentation(tmp_path):
    status, detail = check.judge_cli([_message_file(tmp_path), _snapshot_file(tmp_path)], check.PASS)
    assert status == check.PASS, detail
    assert "fragmentation_oom_message.txt: rank ?: fragmentation: " in detail


def test_mbx_diagnose_on_a_capacity_message_fails_the_verdict(tmp_path):
    from megatron_bridge_ext.device_check import fragmentation_workload as workload

    capacity = _message_file(tmp_path, allocated=workload.BIG - (8 << 20))  # 8 MiB free: no room for 64 MiB
    status, detail = check.judge_cli([capacity], check.PASS)
    assert status == check.FAIL and "capacity" in detail
    assert check.judge_cli([tmp_path / "none.txt"], check.PASS)[0] == check.FAIL


def test_the_budget_counts_from_the_checks_start_not_from_the_import(tmp_path, monkeypatch):
    """A part called on its own runs under its own timeout however long ago the module was imported; once main()
    has started the budget and it is spent, a part is not started."""
    import sys
    import time

    monkeypatch.setattr(check, "_deadline", None)
    assert check._run([sys.executable, "-c", "print('ran')"], timeout=60)[:2] == (0, "ran\n")
    monkeypatch.setattr(check, "_deadline", time.monotonic() - 1)
    status, _, why = check._run([sys.executable, "-c", "print('ran')"], timeout=60)
    assert status == 124 and "budget (--budget) is spent" in why
