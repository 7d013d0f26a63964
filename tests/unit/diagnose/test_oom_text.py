"""PyTorch's OOM messages in every wording, and library OOMs, read into records (CPU only).

The messages are built by tests/support/oom_logs.py from c10's format strings; each figure read back
must equal the one the message was built from, up to ``format_size``'s two decimals.
"""

from __future__ import annotations

import pytest

from megatron_bridge_ext.diagnose.oom_text import parse_allocator, parse_external
from tests.support.oom_logs import GIB, KIB, MIB, allocator_oom

pytestmark = pytest.mark.unit

FIGURES = dict(total=80 * GIB, free=300 * MIB, allocated=61 * GIB + 123 * MIB, reserved=78 * GIB + 7 * MIB)


def _rounding(nbytes: int) -> float:
    """Half of format_size's last decimal in the unit it picks for ``nbytes``."""
    unit = 1 if nbytes <= 1024 else KIB if nbytes <= MIB else MIB if nbytes <= GIB else GIB
    return 0.005 * unit if unit > 1 else 0


def _close(read: int, built: int) -> None:
    assert abs(read - built) <= _rounding(built) + 1, (read, built)


CASES = [
    ("current", {}, "torch-2.1+"),
    ("current", {"private": 3 * GIB}, "torch-2.1+"),
    ("current", {"processes": ((4242, 5 * GIB),), "this_process": 79 * GIB}, "torch-2.1+"),
    ("current", {"allowed": 70 * GIB}, "torch-2.1+"),
    ("2.1", {}, "torch-2.1+"),
    ("2.0", {}, "torch-2.0"),
    ("2.0", {"allowed": 70 * GIB}, "torch-2.0"),
]


@pytest.mark.parametrize("wording, extra, read_as", CASES)
def test_every_wording_gives_back_the_figures_it_was_built_from(wording, extra, read_as):
    message = allocator_oom(2 * GIB + 5 * MIB, **FIGURES, **extra, device=3, wording=wording)
    event = parse_allocator("[rank3]: torch.OutOfMemoryError: " + message)
    assert event is not None and event.wording == read_as
    assert event.device == 3
    _close(event.request, 2 * GIB + 5 * MIB)
    _close(event.total, FIGURES["total"])
    _close(event.free, FIGURES["free"])
    _close(event.allocated, FIGURES["allocated"])
    _close(event.reserved, FIGURES["reserved"])
    _close(event.private_pools, extra.get("private", 0))
    assert (event.allowed is None) == ("allowed" not in extra)
    if "allowed" in extra:
        _close(event.allowed, extra["allowed"])
    assert [pid for pid, _ in event.other_processes] == [p for p, _ in extra.get("processes", ())]
    # what the device holds outside this allocator: total - free - reserved
    _close(event.outside, FIGURES["total"] - FIGURES["free"] - FIGURES["reserved"])


def test_the_private_pool_clause_is_taken_out_of_the_stated_allocated_figure():
    """The message's "allocated by PyTorch" counts the pools' free blocks: the record keeps allocated_bytes."""
    event = parse_allocator(allocator_oom(GIB, **FIGURES, private=4 * GIB))
    _close(event.allocated, FIGURES["allocated"])
    _close(event.unallocated, FIGURES["reserved"] - FIGURES["allocated"] - 4 * GIB)


def test_the_memory_fraction_refusal_keeps_its_request():
    event = parse_allocator("torch.OutOfMemoryError: CUDA out of memory. Allocation was preemptively rejected because "
                            "it would exceed per_process_memory_fraction limit. Requested size: 1.50 GiB.")
    assert event.wording == "fraction-limit" and event.request == 3 * GIB // 2 and event.reserved is None


def test_text_without_the_message_is_not_an_oom():
    assert parse_allocator("iteration 3 | lm loss 2.3 | out of memory handling is fine") is None
    assert parse_allocator("CUDA out of memory. something torch never printed") is None


@pytest.mark.parametrize("line, source", [
    ("node3:1234:1240 [3] NCCL INFO include/alloc.h:125 NCCL WARN Cuda failure 2 'out of memory'", "nccl"),
    ("misc/utils.cc:99 NCCL WARN Cuda failure 'out of memory'", "nccl"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "cublas"),
    ("RuntimeError: CUDA error: out of memory", "cuda-runtime"),
    ("transformer_engine/common/util/cuda_runtime.cpp:41 in function x: CUDA Error: cudaErrorMemoryAllocation",
     "cuda-runtime"),
    ("RuntimeError: Triton Error [CUDA]: out of memory", "triton"),
])
def test_library_ooms_are_named_by_their_library(line, source):
    event = parse_external(line)
    assert event is not None and event.source == source


def test_the_allocator_message_is_never_read_as_a_library_oom():
    assert parse_external(allocator_oom(GIB, **FIGURES)) is None
