"""One rank's out-of-memory event -> its class, the numbers it rests on, and the next step.

The first decision of the OOM procedure, from what PyTorch's message states (:mod:`.oom_text`):

1. **fragmentation** when the memory reserved by PyTorch but unallocated could hold the failed request
   (``unallocated >= request``) and is a real share of the reserve (the thresholds of
   :mod:`.classifier`: >= 10% of reserved and >= 256 MiB): free memory existed, but in pieces.
   Expandable segments (step 1) remove it.
2. **CUDA-graph pools** when the free blocks of private pools, which only their graphs may use, could
   hold the request or are >= 10% of reserved: graph capture keeps its high-water mark away from
   everything else (``CUDACachingAllocator.cpp``, Note [Interaction with CUDA graph capture]).
3. **outside PyTorch's allocator** when another process holds memory on the device, or the memory in
   use but not reserved by this process's allocator (``total - free - reserved``: CUDA context, NCCL
   buffers, library workspaces) is >= 10% of the device: no allocator setting gets that back.
4. **capacity** otherwise: the live tensors fill the device; reduce the peak (steps 2-5).

Out-of-memory errors of NCCL, cuBLAS, the CUDA runtime or Triton are said as such (class **outside
PyTorch's allocator**), with the settings that govern that memory, never as fragmentation or capacity.
Pure: records in, :class:`Verdict` out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from megatron_bridge_ext.diagnose.classifier import GAP_FRACTION, MIN_GAP_BYTES, fmt_bytes
from megatron_bridge_ext.diagnose.oom_text import AllocatorOOM, ExternalOOM
from megatron_bridge_ext.evidence import LEVERS, after_allocator

FRAGMENTATION, CAPACITY, GRAPH_POOLS, OUTSIDE, UNKNOWN = (
    "fragmentation", "capacity", "CUDA-graph pools", "outside PyTorch's allocator", "unknown")
CLASSES = (FRAGMENTATION, CAPACITY, GRAPH_POOLS, OUTSIDE, UNKNOWN)
OUTSIDE_FRACTION = 0.10
"""Memory outside this process's allocator above 10% of the device is more than a CUDA context (about
0.5-1 GiB) and NCCL's default buffers take on an 80 GB GPU: worth naming before the peak is cut."""

GRAPH_STEP = {"step": None, "name": "CUDA graphs",
              "action": "capture fewer layers (model.cuda_graph_scope), or model.cuda_graph_impl=none to see the "
                        "peak without graphs; then the decision order",
              "cost": "graphs save CPU launch time; their pools keep their high-water mark for the run"}
OUTSIDE_STEP = {"step": None, "name": "memory outside PyTorch",
                "action": "one training process per GPU (stop the other processes `nvidia-smi` lists); smaller NCCL "
                          "buffers (NCCL_BUFFSIZE, NCCL_NVLS_ENABLE=0); leave headroom with "
                          "torch.cuda.set_per_process_memory_fraction",
                "cost": "none for stray processes; smaller NCCL buffers can slow collectives"}
EXTERNAL_STEPS = {
    "nccl": "NCCL could not allocate its buffers: NCCL_BUFFSIZE (default 4 MiB per channel and peer), "
            "NCCL_NVLS_ENABLE=0 (NVLink SHARP buffers), ddp.nccl_ub=false, fewer process groups; expandable "
            "segments let PyTorch return freed pages so that NCCL finds them",
    "cublas": "cuBLAS could not allocate its handle or workspace: leave headroom outside PyTorch's allocator "
              "(expandable segments return freed pages; CUBLAS_WORKSPACE_CONFIG=:4096:8 caps the workspace)",
    "cuda-runtime": "a CUDA runtime allocation outside PyTorch's allocator failed (CUDA context, a library, a "
                    "custom kernel): leave headroom (expandable segments return freed pages; "
                    "torch.cuda.set_per_process_memory_fraction keeps PyTorch below the device total)",
    "triton": "a Triton kernel's launch or autotuning could not allocate memory: leave headroom outside PyTorch's "
              "allocator (expandable segments), or disable autotuning of that kernel",
}


@dataclass(frozen=True)
class Verdict:
    kind: str
    summary: str
    next_step: dict
    numbers: dict
    notes: tuple = ()

    def to_dict(self) -> dict:
        out = asdict(self)
        out["notes"] = list(self.notes)
        return out


def _step(index: int, expandable: Optional[bool]) -> dict:
    """The next lever; with expandable segments already on, step 1 is spent. Step 2 acts on LoRA runs only, so it
    comes with the step for the others (:func:`~megatron_bridge_ext.evidence.after_allocator`)."""
    if index == 0 and expandable is True:
        index = 1
    return after_allocator() if index == 1 else dict(LEVERS[index])


def classify_message(event: AllocatorOOM, *, expandable: Optional[bool] = None) -> Verdict:
    """Class of one caching-allocator OOM from its message's figures."""
    request = event.request
    if event.wording == "fraction-limit":
        return Verdict(CAPACITY, f"the request of {fmt_bytes(request)} would exceed the per-process memory fraction "
                                 "(torch.cuda.set_per_process_memory_fraction)", _step(1, expandable),
                       {"request_bytes": request},
                       ("raise the fraction if the device has room; else reduce the peak",))
    reserved, unallocated, private, outside = event.reserved, event.unallocated, event.private_pools, event.outside
    numbers = {"request_bytes": request, "total_bytes": event.total, "free_bytes": event.free,
               "allocated_bytes": event.allocated, "reserved_bytes": reserved, "unallocated_bytes": unallocated,
               "private_pool_bytes": private, "outside_bytes": outside, "allowed_bytes": event.allowed,
               "this_process_bytes": event.this_process, "other_processes": [list(p) for p in event.other_processes]}
    if reserved is None or unallocated is None:
        return Verdict(UNKNOWN, "the message lacks the allocated and reserved figures", _step(1, expandable), numbers)
    notes = []
    if event.this_process_pid is not None:
        numbers["this_process_pid"] = event.this_process_pid
        notes.append(f"'Process {event.this_process_pid} has {fmt_bytes(event.this_process)} memory in use' is this "
                     f"process: it uses at least the {fmt_bytes(reserved)} its allocator reserved, and PyTorch names "
                     "its own process by pid when the pid NVML reports is not the one it sees (a container's PID "
                     "namespace)")
    share = unallocated / reserved if reserved else 0.0
    if request is not None and unallocated >= request and unallocated >= MIN_GAP_BYTES and share >= GAP_FRACTION:
        summary = (f"{fmt_bytes(unallocated)} reserved but unallocated ({share:.1%} of {fmt_bytes(reserved)} "
                   f"reserved) could hold the failed request of {fmt_bytes(request)}, but in no one piece")
        if expandable is True:
            notes.append("expandable segments are on already: reduce the peak next")
        return Verdict(FRAGMENTATION, summary, _step(0, expandable), numbers, tuple(notes))
    if private and ((request is not None and private >= request) or private >= GAP_FRACTION * reserved):
        summary = (f"{fmt_bytes(private)} sit free in CUDA-graph private pools ({private / reserved:.1%} of "
                   f"{fmt_bytes(reserved)} reserved), usable only by their graphs; the request was "
                   f"{fmt_bytes(request)}")
        return Verdict(GRAPH_POOLS, summary, dict(GRAPH_STEP), numbers, tuple(notes))
    others = sum(size for _, size in event.other_processes)
    capacity = event.allowed or event.total
    if others or (outside is not None and capacity and outside >= OUTSIDE_FRACTION * capacity):
        parts = [f"{fmt_bytes(outside)} of the device is in use outside this process's allocator"]
        if others:
            parts.append(f"{len(event.other_processes)} other process{'es' if len(event.other_processes) > 1 else ''} "
                         f"hold {fmt_bytes(others)} (" + ", ".join(f"pid {p}: {fmt_bytes(s)}"
                                                                  for p, s in event.other_processes[:4]) + ")")
        return Verdict(OUTSIDE, "; ".join(parts), dict(OUTSIDE_STEP), numbers, tuple(notes))
    of = f" of the device's {fmt_bytes(capacity)}" if capacity else ""
    summary = (f"{fmt_bytes(event.allocated)} allocated{of} ({event.allocated / capacity:.1%})" if capacity else
               f"{fmt_bytes(event.allocated)} allocated") + (
        f"; only {fmt_bytes(unallocated)} reserved but unallocated and {fmt_bytes(event.free)} free for a request "
        f"of {fmt_bytes(request)}")
    if expandable is not True:
        notes.append("expandable segments cost nothing and are worth turning on, but they do not fix a capacity OOM")
    return Verdict(CAPACITY, summary, _step(1, expandable), numbers, tuple(notes))


def classify_external(event: ExternalOOM) -> Verdict:
    """An OOM raised by a library: outside PyTorch's allocator, with that library's settings."""
    return Verdict(OUTSIDE, f"{event.source} ran out of memory outside PyTorch's caching allocator: {event.text[:160]}",
                   {"step": None, "name": f"{event.source} memory", "action": EXTERNAL_STEPS[event.source],
                    "cost": "depends on the setting"}, {"source": event.source})
