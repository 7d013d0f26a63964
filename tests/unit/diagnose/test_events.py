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


CONTAINER_OOM = ("CUDA out of memory. Tried to allocate 3.50 GiB. GPU 1 has a total capacity of 79.10 GiB of which "
                 "512.00 MiB is free. Process 2431574 has 78.58 GiB memory in use. Of the allocated memory 76.90 GiB is "
                 "allocated by PyTorch, and 250.00 MiB is reserved by PyTorch but unallocated. If reserved but "
                 "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
                 "fragmentation.  See documentation for Memory Management  "
                 "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
"""A capacity OOM inside a container, as torch 2.14.1 words it: c10/cuda/CUDACachingAllocator.cpp
``reportProcessMemoryInfo`` writes ``"Process " << pid << " has " << format_size(usedGpuMemory) << " memory in use. "``
for every NVML process whose pid is not ``getpid()``, and inside a PID namespace NVML's host pid never is."""


def test_a_container_oom_names_its_own_process_by_pid_and_is_classed_on_its_numbers():
    """78.58 GiB in use is at least the 77.15 GiB (76.90 + 0.25) this process reserved: it is this process, so
    nothing outside it holds the device (79.10 - 0.5 - 77.15 = 1.45 GiB outside, under 10%): capacity."""
    event = parse_allocator(CONTAINER_OOM)
    assert event.this_process_pid == 2431574 and event.other_processes == ()
    assert event.this_process == round(78.58 * GIB)
    v = events.classify_message(event)
    assert v.kind == events.CAPACITY and v.next_step["step"] == 2
    assert any(note.startswith("'Process 2431574 has 78.58 GiB memory in use' is this process") for note in v.notes)


@pytest.mark.parametrize("processes, own", [
    (((2431574, 78 * GIB), (555, 1 * GIB)), 2431574),  # the one at least as large as the reserve is this process
    (((9, 77 * GIB),), 9),  # exactly the reserve (its CUDA context shows in no line here): this process
    (((2431574, 70 * GIB),), None),  # below the reserve: another process (this one has no line)
    (((1, 78 * GIB), (2, 78 * GIB)), None),  # two could be: neither is taken
], ids=["one-over-the-reserve", "at-the-reserve", "under-the-reserve", "two-candidates"])
def test_only_one_listed_process_using_at_least_the_reserve_is_taken_as_this_one(processes, own):
    event = parse_allocator(allocator_oom(2 * GIB, total=80 * GIB, free=100 * MIB, allocated=76 * GIB,
                                          reserved=77 * GIB, processes=processes))
    assert event.this_process_pid == own
    assert [p for p, _ in event.other_processes] == [p for p, _ in processes if p != own]


def test_the_capacity_step_says_which_runs_it_applies_to_and_the_next_lever_for_the_others():
    """Step 2 keeps LoRA-A's input as a shard: a run without LoRA (full fine-tuning, pretraining, a Megatron-LM log)
    has none, so the next step names the runs it is for and, for the rest, step 3."""
    from megatron_bridge_ext.diagnose.report import Failure

    v = _verdict(2 * GIB, total=80 * GIB, free=200 * MIB, allocated=78 * GIB, reserved=78 * GIB + 600 * MIB)
    assert v.kind == events.CAPACITY and v.next_step["step"] == 2
    assert v.next_step["applies_to"] == "runs that train LoRA adapters with sequence parallelism"
    assert v.next_step["otherwise"]["step"] == 3
    headline = Failure(0, v, "").headline()
    assert "next (step 2 of 5, LoRA input under sequence parallelism): for runs that train LoRA adapters with " \
           "sequence parallelism: " in headline
    assert "otherwise (full fine-tuning, pretraining, no SP) step 3, selective recompute: " in headline
