"""The fragmentation workload's geometry is what the OOM classifier and the snapshot reader call fragmentation."""

from __future__ import annotations

import io
import pickle

import pytest

from megatron_bridge_ext.device_check import fragmentation_workload as workload
from megatron_bridge_ext.diagnose import classify
from megatron_bridge_ext.diagnose.snapshot import read_snapshot


def test_the_fragmentation_geometry_is_diagnosed_as_fragmentation():
    stats = workload.stats_at_the_oom()
    assert stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"] == workload.BIG // 2
    diagnosis = classify(stats, total_memory=workload.BIG + workload.HEADROOM, expandable_segments=False,
                         request_bytes=stats["request_bytes"])
    assert diagnosis.kind == "fragmentation"


def test_the_fragmentation_geometrys_snapshot_shows_fragmentation_from_its_blocks():
    data = pickle.dumps(workload.snapshot_at_the_oom())
    (device,) = read_snapshot(io.BytesIO(data), workload.SNAPSHOT).devices
    assert (device.reserved_bytes, device.segment_count) == (workload.BIG, 1)
    assert device.free_bytes == device.inactive_split_bytes == device.allocated_bytes == workload.BIG // 2
    assert device.largest_free_block_bytes == workload.PIECE
    assert device.oom.request_bytes == 2 * workload.PIECE
    assert (device.verdict.kind, device.verdict.fragmentation) == ("fragmentation", "shown")


def test_keep_refuses_a_file_in_one_line_before_any_work(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(SystemExit) as exit_:
        workload.main(["--mode", "default", "--keep", str(not_a_folder)])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--keep {not_a_folder}: not a folder" in error
