"""The runtime OOM handler: the same exception re-raised, a complete report written, never a report in its place (CPU only)."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest
import torch

from megatron_bridge_ext.diagnose import OOMHandler, diagnose_file, oom_guard
from megatron_bridge_ext.diagnose.handler import write_atomic
from tests.support.memstats import GiB, capacity_stats, fragmentation_stats
from tests.support.diagnose import OOM_MESSAGE

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------------------------
# OOM handler
# --------------------------------------------------------------------------------------------


def _step():
    raise torch.OutOfMemoryError(OOM_MESSAGE)


def test_handler_reraises_the_same_exception_and_writes_a_complete_report(tmp_path):
    stream = io.StringIO()
    with pytest.raises(torch.OutOfMemoryError) as info:
        with OOMHandler(str(tmp_path), rank=3, stats_fn=fragmentation_stats, stream=stream) as handler:
            try:
                _step()
            except torch.OutOfMemoryError as error:
                raised = error
                raise
    assert info.value is raised
    assert info.traceback[-1].name == "_step"  # the traceback still ends where the OOM was raised
    path = tmp_path / "oom_rank3.json"
    assert handler.report_path == str(path)
    report = json.loads(path.read_text())
    assert report["format"] == "megatron_bridge_ext.oom_report/1"
    assert report["rank"] == 3 and report["pid"] == os.getpid()
    assert report["exception"] == {"type": "OutOfMemoryError", "message": OOM_MESSAGE}
    assert report["stats"] == fragmentation_stats()
    assert report["request_bytes"] == 2 * GiB and report["total_memory"] == int(79.19 * GiB)
    assert set(report["allocator"]) >= {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments"}
    assert report["diagnosis"]["kind"] == "fragmentation" and report["diagnosis_error"] is None
    assert report["snapshot"] is None  # no device, no history recording
    assert sorted(p.name for p in tmp_path.iterdir()) == ["oom_rank3.json"]  # no temporary file left
    printed = stream.getvalue().splitlines()
    assert printed[0].startswith("[rank 3] out of memory; report:") and printed[2].startswith("fragmentation:")
    assert printed[1] == report["headline"]


def test_the_handler_prints_the_headline_mbx_diagnose_prints_for_the_same_message_in_a_log(tmp_path):
    from megatron_bridge_ext.diagnose.collect import diagnose_inputs

    stream = io.StringIO()
    with pytest.raises(torch.OutOfMemoryError):
        with OOMHandler(str(tmp_path), rank=3, stats_fn=fragmentation_stats, stream=stream) as handler:
            _step()
    log = tmp_path / "train.log"
    log.write_text(f"[rank3]: torch.OutOfMemoryError: {OOM_MESSAGE}\n")
    expandable = handler.report["allocator"]["expandable_segments"]  # as the process had it: mbx diagnose is told
    from_log = diagnose_inputs([str(log)], expandable=expandable).failures[0].headline()
    assert stream.getvalue().splitlines()[1] == from_log
    assert from_log.startswith("rank 3: fragmentation: ")


def test_report_can_be_diagnosed_again_from_the_file(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        with OOMHandler(str(tmp_path), rank=0, stats_fn=capacity_stats, stream=io.StringIO()):
            _step()
    d = diagnose_file(str(tmp_path / "oom_rank0.json"))
    assert d.kind == "capacity" and d.metrics["request_bytes"] == 2 * GiB


def test_other_exceptions_pass_through_without_a_report(tmp_path):
    error = ValueError("not memory")
    with pytest.raises(ValueError) as info:
        with OOMHandler(str(tmp_path), rank=0, stats_fn=fragmentation_stats):
            raise error
    assert info.value is error and list(tmp_path.iterdir()) == []


def test_a_failing_report_never_replaces_the_oom(tmp_path, caplog):
    def broken():
        raise RuntimeError("stats unavailable")

    error = torch.OutOfMemoryError("CUDA out of memory.")
    with caplog.at_level(logging.ERROR, logger="megatron_bridge_ext.diagnose"):
        with pytest.raises(torch.OutOfMemoryError) as info:
            with OOMHandler(str(tmp_path), rank=0, stats_fn=broken):
                raise error
    assert info.value is error and info.value.__context__ is None
    assert "could not write the OOM report" in caplog.text


def test_unclassifiable_stats_still_give_a_report(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        with OOMHandler(str(tmp_path), rank=1, stats_fn=dict, stream=io.StringIO()):
            raise torch.OutOfMemoryError("CUDA out of memory.")
    report = json.loads((tmp_path / "oom_rank1.json").read_text())
    assert report["diagnosis"] is None and "empty before CUDA is initialised" in report["diagnosis_error"]


def test_oom_guard_decorator_keeps_the_function_and_reports(tmp_path):
    @oom_guard(report_dir=str(tmp_path), rank=2, stats_fn=fragmentation_stats, stream=io.StringIO())
    def train_step(x):
        """Bridge-like step."""
        if x < 0:
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return x * 2

    assert train_step(3) == 6 and train_step.__doc__ == "Bridge-like step." and list(tmp_path.iterdir()) == []
    with pytest.raises(torch.OutOfMemoryError):
        train_step(-1)
    assert (tmp_path / "oom_rank2.json").is_file()


def test_rank_comes_from_the_environment_when_not_given(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(torch.OutOfMemoryError):
        with OOMHandler(str(tmp_path), stats_fn=fragmentation_stats, stream=io.StringIO()):
            raise torch.OutOfMemoryError("CUDA out of memory.")
    assert json.loads((tmp_path / "oom_rank5.json").read_text())["rank"] == 5


def test_write_atomic_leaves_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")

    def half(f):
        f.write("{\"partial\":")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomic(str(target), half)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
