"""The class of one rank's OOM from its message: fragmentation, capacity, CUDA-graph pools, outside the allocator."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.diagnose import events
from megatron_bridge_ext.diagnose.oom_text import ExternalOOM, parse_allocator, parse_external
from tests.support.oom_logs import GIB, MIB, allocator_oom

pytestmark = pytest.mark.unit


def _verdict(request, expandable=None, **figures):
    return events.classify_message(parse_allocator(allocator_oom(request, **figures)), expandable=expandable)


def test_free_pieces_that_would_hold_the_request_are_fragmentation_and_step_1_is_next():
    v = _verdict(2 * GIB, total=80 * GIB, free=200 * MIB, allocated=60 * GIB, reserved=79 * GIB)
    assert v.kind == events.FRAGMENTATION
    assert v.next_step["step"] == 1
    assert v.numbers["unallocated_bytes"] == 19 * GIB


def test_with_expandable_segments_on_the_next_step_is_the_second_lever():
    v = _verdict(2 * GIB, expandable=True, total=80 * GIB, free=200 * MIB, allocated=60 * GIB, reserved=79 * GIB)
    assert v.kind == events.FRAGMENTATION and v.next_step["step"] == 2


def test_a_request_larger_than_the_free_pieces_is_not_fragmentation():
    """19 GiB reserved but unallocated cannot hold a 20 GiB request: no allocator could have placed it there."""
    v = _verdict(20 * GIB, total=80 * GIB, free=200 * MIB, allocated=60 * GIB, reserved=79 * GIB)
    assert v.kind == events.CAPACITY and v.next_step["step"] == 2


def test_a_small_gap_is_capacity():
    v = _verdict(2 * GIB, total=80 * GIB, free=200 * MIB, allocated=78 * GIB, reserved=78 * GIB + 600 * MIB)
    assert v.kind == events.CAPACITY


def test_free_blocks_of_cuda_graph_pools_are_named():
    v = _verdict(2 * GIB, total=80 * GIB, free=200 * MIB, allocated=68 * GIB, reserved=79 * GIB, private=10 * GIB)
    assert v.kind == events.GRAPH_POOLS
    assert "cuda_graph" in v.next_step["action"]


def test_another_process_on_the_device_is_outside_the_allocator():
    v = _verdict(2 * GIB, total=80 * GIB, free=100 * MIB, allocated=60 * GIB, reserved=60 * GIB + 300 * MIB,
                 processes=((777, 19 * GIB),))
    assert v.kind == events.OUTSIDE and "pid 777" in v.summary


def test_a_large_share_of_the_device_outside_the_allocator_is_named():
    """total - free - reserved = 80 - 0.1 - 60.3 = 19.6 GiB: NCCL, context, libraries."""
    v = _verdict(2 * GIB, total=80 * GIB, free=100 * MIB, allocated=60 * GIB, reserved=60 * GIB + 300 * MIB)
    assert v.kind == events.OUTSIDE
    assert abs(v.numbers["outside_bytes"] - (80 * GIB - 100 * MIB - 60 * GIB - 300 * MIB)) < 0.01 * GIB


def test_a_library_oom_is_outside_the_allocator_with_its_settings():
    v = events.classify_external(parse_external("NCCL WARN Cuda failure 2 'out of memory'"))
    assert v.kind == events.OUTSIDE and "NCCL_BUFFSIZE" in v.next_step["action"]
    for source in events.EXTERNAL_STEPS:
        assert events.classify_external(ExternalOOM(source, "x")).kind == events.OUTSIDE
