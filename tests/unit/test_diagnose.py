"""OOM classification from memory_stats() dictionaries, and the OOM handler (CPU only)."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest
import torch

from megatron_bridge_ext.diagnose import classifier as diagnose
from megatron_bridge_ext.diagnose import DECISION_ORDER, OOMHandler, classify, diagnose_file, oom_guard, parse_oom_message
from megatron_bridge_ext.diagnose.classifier import MIN_GAP_BYTES
from megatron_bridge_ext.diagnose.handler import write_atomic
from tests.support.memstats import GiB, MiB, capacity_stats, fragmentation_stats, memory_stats

pytestmark = pytest.mark.unit

OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
               "1.52 GiB is free. Including non-PyTorch memory, this process has 77.66 GiB memory in use. Of the "
               "allocated memory 52.00 GiB is allocated by PyTorch, and 22.60 GiB is reserved by PyTorch but "
               "unallocated.")


# --------------------------------------------------------------------------------------------
# classify
# --------------------------------------------------------------------------------------------


def test_fragmentation_stats_are_fragmentation_and_the_next_step_is_the_allocator():
    d = classify(fragmentation_stats(), expandable_segments=False, request_bytes=2 * GiB)
    assert d.kind == "fragmentation"
    assert d.headline.startswith("fragmentation: 22.60 GiB reserved but unallocated")
    assert d.next_step["step"] == 1 and d.next_step["name"] == "allocator"
    assert d.row == diagnose.TABLE["fragmentation"]
    gap = d.metrics["reserved_bytes"] - d.metrics["allocated_bytes"]
    assert d.metrics["reserved_unallocated_bytes"] == gap == 22 * GiB + 614 * MiB
    assert any("4 allocation retries" in e for e in d.evidence)
    assert any("(2.00 GiB) is smaller than" in e for e in d.evidence)


def test_fragmentation_with_expandable_segments_on_moves_to_step_two():
    d = classify(fragmentation_stats(), allocator_settings="max_split_size_mb:512,expandable_segments:True")
    assert d.kind == "fragmentation" and d.metrics["expandable_segments"] is True
    assert d.next_step["step"] == 2 and "already on" in d.notes[0]


def test_capacity_stats_are_capacity_and_the_next_step_is_lora_input():
    d = classify(capacity_stats(), total_memory=int(79.19 * GiB), expandable_segments=False)
    assert d.kind == "capacity"
    assert d.headline.startswith("capacity: 76.90 GiB allocated of 79.19 GiB device memory")
    assert d.next_step["step"] == 2 and 'sequence_parallel_input_strategy="shard_local"' in d.next_step["action"]
    assert d.row == diagnose.TABLE["capacity"]
    assert any("do not fix a capacity OOM" in n for n in d.notes)


def test_capacity_notes_memory_outside_the_allocator():
    stats = memory_stats(allocated=50 * GiB, reserved=51 * GiB, inactive_split=200 * MiB)
    d = classify(stats, total_memory=80 * GiB)
    assert d.kind == "capacity" and any("outside PyTorch's allocator" in n for n in d.notes)


def test_thresholds_decide_at_their_documented_boundaries():
    """Documented: gap >= 10% of reserved, or inactive split >= 5% of reserved, and gap >= 256 MiB.

    The boundaries are exact: a value AT the threshold counts (>=), one byte below does not.
    """
    reserved = 40 * GiB  # 10% = 4 GiB, 5% = 2 GiB
    quiet_split = 2 * GiB - 64 * MiB  # below its own threshold, so the gap alone decides
    at = memory_stats(allocated=reserved - 4 * GiB, reserved=reserved, inactive_split=quiet_split)
    below = memory_stats(allocated=reserved - 4 * GiB + 1, reserved=reserved, inactive_split=quiet_split)
    assert (classify(at).kind, classify(below).kind) == ("fragmentation", "capacity")
    gap = 3 * GiB  # below 10%: the inactive split alone decides
    split_at = memory_stats(allocated=reserved - gap, reserved=reserved, inactive_split=2 * GiB)
    split_below = memory_stats(allocated=reserved - gap, reserved=reserved, inactive_split=2 * GiB - 1)
    assert (classify(split_at).kind, classify(split_below).kind) == ("fragmentation", "capacity")
    small = 1 * GiB  # 256 MiB floor: a gap of exactly 256 MiB counts, one byte less does not
    floor_at = memory_stats(allocated=small - 256 * MiB, reserved=small, inactive_split=0)
    floor_below = memory_stats(allocated=small - 256 * MiB + 1, reserved=small, inactive_split=0)
    assert (classify(floor_at).kind, classify(floor_below).kind) == ("fragmentation", "capacity")


def test_small_gap_is_capacity_even_when_its_fraction_is_high():
    stats = memory_stats(allocated=1 * GiB, reserved=1 * GiB + MIN_GAP_BYTES - 2 * MiB,
                         inactive_split=MIN_GAP_BYTES - 64 * MiB, small_reserved=4 * MiB, small_allocated=2 * MiB)
    assert classify(stats).kind == "capacity"


def test_missing_or_empty_stats_are_an_error_that_says_what_to_pass():
    with pytest.raises(ValueError, match="reserved_bytes.all.current"):
        classify({"allocated_bytes.all.current": 1})
    with pytest.raises(ValueError, match="empty before CUDA is initialised"):
        classify({})
    with pytest.raises(ValueError, match="cudaMallocAsync"):
        classify({"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0})


def test_format_starts_with_the_class_and_lists_the_decision_order():
    text = classify(fragmentation_stats()).format()
    lines = text.splitlines()
    assert lines[0].startswith("fragmentation:")
    steps = [line for line in lines if line.startswith("  ") and line[2:3].isdigit()]
    assert [line[:5] for line in steps[-len(DECISION_ORDER):]] == [f"  {i}. " for i in range(1, len(DECISION_ORDER) + 1)]
    assert steps[-len(DECISION_ORDER)].startswith("  1. allocator")
    assert lines[-1].startswith("source of the figures: Megatron Bridge documentation")
    assert "-28.4%" in text and "-5.9%" in text and "PP = 1" in text


def test_parse_oom_message():
    parsed = parse_oom_message(OOM_MESSAGE)
    assert parsed == {"request_bytes": 2 * GiB, "total_capacity_bytes": int(79.19 * GiB), "free_bytes": int(1.52 * GiB)}
    assert parse_oom_message("something else") == {"request_bytes": None, "total_capacity_bytes": None,
                                                   "free_bytes": None}


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
    assert printed[0].startswith("[rank 3] out of memory; report:") and printed[1].startswith("fragmentation:")


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


def test_a_gb_total_below_reserved_explains_the_gpu_sales_figure():
    """A GPU sold as "80GB" whose allocator reserved 77 GiB: 80 GB (74.5 GiB) is refused with the GiB fix."""
    stats = memory_stats(allocated=76 * GiB, reserved=77 * GiB, inactive_split=300 * MiB)
    with pytest.raises(ValueError) as error:
        classify(stats, total_memory=80 * 10**9)
    message = str(error.value)
    assert message.startswith("--total-memory 80GB is 74.51 GiB (GB = 10^9 bytes), less than the 77.00 GiB reserved")
    assert 'holds about 80 GiB' in message and ". Fix: --total-memory 80GiB" in message
    assert classify(stats, total_memory=80 * GiB).kind == "capacity"


def test_a_gb_total_that_holds_the_reserved_bytes_gets_a_note_not_a_new_reading():
    d = classify(capacity_stats(), total_memory=80 * 10**9 + 40 * 10**9)  # 120GB: no GPU size, still in GB
    assert d.metrics["total_memory"] == 120 * 10**9  # read as written
    assert any(n.startswith("--total-memory 120GB is 111.76 GiB") and "--total-memory 120GiB" in n for n in d.notes)
    assert not any("120GB" in n for n in classify(capacity_stats(), total_memory=120 * GiB).notes)
