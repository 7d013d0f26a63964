"""The fragmentation workload's geometry is what the OOM classifier calls fragmentation."""

from __future__ import annotations

from megatron_bridge_ext.device_check import fragmentation_workload as workload
from megatron_bridge_ext.diagnose import classify


def test_the_fragmentation_geometry_is_diagnosed_as_fragmentation():
    stats = workload.stats_at_the_oom()
    assert stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"] == workload.BIG // 2
    diagnosis = classify(stats, total_memory=workload.BIG + workload.HEADROOM, expandable_segments=False,
                         request_bytes=stats["request_bytes"])
    assert diagnosis.kind == "fragmentation"
