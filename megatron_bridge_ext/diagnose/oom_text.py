"""PyTorch's out-of-memory messages, and out-of-memory errors from outside its allocator, as records.

The caching allocator's message (``c10/cuda/CUDACachingAllocator.cpp``, ``DeviceCachingAllocator::malloc``)
is assembled from pieces; sizes come from its ``format_size`` (``N bytes``, or two decimals of KiB,
MiB or GiB). The wordings read here, each with the torch versions that print it:

* torch 2.0::

      "CUDA out of memory. Tried to allocate {request} (GPU {d}; {total} total capacity; {allocated}
      already allocated; {free} free; [{allowed} allowed; ]{reserved} reserved in total by PyTorch)
      If reserved memory is >> allocated memory try setting max_split_size_mb ..."

* torch 2.1 (one word misspelt, ``capacty``) and torch >= 2.2::

      "CUDA out of memory. Tried to allocate {request}. GPU {d} has a total capacity of {total} of
      which {free} is free. {proc_info}{allowed_info}Of the allocated memory {allocated} is allocated
      by PyTorch, and {unallocated} is reserved by PyTorch but unallocated. If reserved but
      unallocated memory is large try setting ..."

  where ``proc_info`` is, per process on the device (NVML), ``"Process {pid} has {bytes} memory in
  use. "``, or for the failing process itself ``"Including non-PyTorch memory, this process has
  {bytes} memory in use. "``, and ``allowed_info`` is ``"{allowed} allowed; "`` under
  ``torch.cuda.set_per_process_memory_fraction``;

* torch >= 2.3 adds, when CUDA-graph private pools hold free blocks, ``"... is allocated by PyTorch,
  with {private} allocated in private pools (e.g., CUDA Graphs), and {unallocated} is reserved by
  PyTorch but unallocated."``. Then the stated ``allocated`` counts those pool blocks too, and
  ``unallocated = reserved - allocated_bytes - private`` (the same source): the record keeps
  ``allocated_bytes`` (stated minus private), so that ``reserved = allocated + private + unallocated``;

* torch >= 2.10 (checked in the installed 2.14.1's ``libc10_cuda.so``) may refuse before calling CUDA:
  ``"CUDA out of memory. Allocation was preemptively rejected because it would exceed
  per_process_memory_fraction limit. Requested size: {request}..."``.

Out of memory outside the caching allocator is recognised by the library's own words and kept apart:
NCCL's ``Cuda failure 2 'out of memory'`` (``NCCL WARN``; older NCCL omits the code), cuBLAS's
``CUBLAS_STATUS_ALLOC_FAILED``, the CUDA runtime's ``cudaErrorMemoryAllocation`` / ``CUDA error: out of
memory`` and Triton's ``Triton Error [CUDA]: out of memory``.

Pure: text in, records out; the classification is :mod:`.events`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "EiB": 1 << 60}
_SIZE = r"([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB)"

ALLOCATOR_MARK = "CUDA out of memory."


def size_bytes(number: str, unit: str) -> int:
    """Bytes of one ``format_size`` figure; its two decimals make it exact to 1% of the last unit."""
    return int(round(float(number) * _UNITS[unit]))


@dataclass(frozen=True)
class AllocatorOOM:
    """One caching-allocator OOM message: every figure in bytes, None where the wording lacks it."""

    wording: str  # "torch-2.0" | "torch-2.1+" | "fraction-limit"
    request: Optional[int]
    device: Optional[int] = None
    total: Optional[int] = None
    free: Optional[int] = None
    allocated: Optional[int] = None  # allocated_bytes: live blocks
    unallocated: Optional[int] = None  # reserved, neither live nor in a private pool
    private_pools: int = 0  # free blocks of private pools
    allowed: Optional[int] = None
    this_process: Optional[int] = None
    other_processes: tuple = ()  # ((pid, bytes), ...)
    this_process_pid: Optional[int] = None
    """The pid of a ``Process <pid> has ...`` line read as this process (:func:`_own_process`): inside a container
    PyTorch prints its own usage so."""

    @property
    def reserved(self) -> Optional[int]:
        """All PyTorch reserved: live blocks, private pools' free blocks, free pieces of its segments."""
        if self.allocated is None or self.unallocated is None:
            return None
        return self.allocated + self.private_pools + self.unallocated

    @property
    def outside(self) -> Optional[int]:
        """Device memory in use but not reserved by this process's allocator: CUDA context, NCCL, libraries,
        other processes. ``total - free - reserved``."""
        if None in (self.total, self.free, self.reserved):
            return None
        return max(self.total - self.free - self.reserved, 0)

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["other_processes"] = [list(p) for p in self.other_processes]
        out.update(reserved=self.reserved, outside=self.outside)
        return out


@dataclass(frozen=True)
class ExternalOOM:
    """Out of memory raised outside PyTorch's caching allocator, by a library."""

    source: str  # "nccl" | "cublas" | "cuda-runtime" | "triton"
    text: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


_NEW = re.compile(
    r"Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total capac(?:i)?ty of " + _SIZE + r" of which " + _SIZE
    + r" is free\. (.*?)Of the allocated memory " + _SIZE + r" is allocated by PyTorch, (?:with " + _SIZE
    + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?and " + _SIZE + r" is reserved by PyTorch but "
    r"unallocated\.")
_OLD = re.compile(
    r"Tried to allocate " + _SIZE + r" \(GPU (\d+); " + _SIZE + r" total capacity; " + _SIZE + r" already allocated; "
    + _SIZE + r" free; (?:" + _SIZE + r" allowed; )?" + _SIZE + r" reserved in total by PyTorch\)")
_FRACTION = re.compile(r"preemptively rejected because it would exceed per_process_memory_fraction limit\. "
                       r"Requested size: " + _SIZE)
_ALLOWED = re.compile(_SIZE + r" allowed; ")
_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use\. ")
_SELF = re.compile(r"Including non-PyTorch memory, this process has " + _SIZE + r" memory in use\. ")
_EXTERNAL = (
    ("nccl", re.compile(r"Cuda failure (?:\d+ )?'out of memory'")),
    ("cublas", re.compile(r"CUBLAS_STATUS_ALLOC_FAILED")),
    ("triton", re.compile(r"Triton Error \[CUDA\]: out of memory")),
    ("cuda-runtime", re.compile(r"cudaErrorMemoryAllocation|CUDA error: out of memory")),
)


def _size(match: re.Match, first: int) -> Optional[int]:
    number = match.group(first)
    return None if number is None else size_bytes(number, match.group(first + 1))


def parse_allocator(text: str) -> Optional[AllocatorOOM]:
    """The caching allocator's OOM message in ``text`` (one line), or None."""
    if ALLOCATOR_MARK not in text:
        return None
    new = _NEW.search(text)
    if new:
        info = new.group(8)
        allowed = _ALLOWED.search(info)
        own = _SELF.search(info)
        private = _size(new, 11) or 0
        allocated, unallocated = _size(new, 9) - private, _size(new, 13)
        processes = tuple((int(p.group(1)), size_bytes(p.group(2), p.group(3))) for p in _PROCESS.finditer(info))
        mine = None if own else _own_process(processes, allocated + private + unallocated)
        if mine is not None:
            processes = tuple(p for p in processes if p != mine)
        return AllocatorOOM(  # the message's "allocated by PyTorch" counts the private pools' free blocks
            "torch-2.1+", _size(new, 1), int(new.group(3)), _size(new, 4), _size(new, 6), allocated, unallocated,
            private, _size(allowed, 1) if allowed else None,
            _size(own, 1) if own else (mine[1] if mine else None), processes,
            this_process_pid=mine[0] if mine else None)
    old = _OLD.search(text)
    if old:
        allocated, reserved = _size(old, 6), _size(old, 12)
        return AllocatorOOM("torch-2.0", _size(old, 1), int(old.group(3)), _size(old, 4), _size(old, 8),
                            allocated, max(reserved - allocated, 0), 0, _size(old, 10))
    fraction = _FRACTION.search(text)
    if fraction:
        return AllocatorOOM("fraction-limit", _size(fraction, 1))
    return None


def _own_process(processes: tuple, reserved: int) -> Optional[tuple]:
    """The listed process that is this one, when the message has no ``this process has`` line, else None.

    c10 words its per-process lines (``reportProcessMemoryInfo``) from NVML's list of the device's processes:
    ``"Including non-PyTorch memory, this process has %s memory in use. "`` for the entry whose pid equals
    ``getpid()``, ``"Process %d has %s memory in use. "`` for every other. Inside a PID namespace (Docker, enroot,
    Kubernetes) NVML reports host pids, which never equal the container's ``getpid()``, so the failing process is
    listed as ``Process <host pid>``. A process uses at least what its allocator reserved (``reserved`` bytes, plus
    its CUDA context): exactly one listed process using that much is this process; none, or more than one, leaves
    the lines as they are."""
    candidates = [p for p in processes if p[1] >= reserved]
    return candidates[0] if len(candidates) == 1 else None


def parse_external(text: str) -> Optional[ExternalOOM]:
    """An out-of-memory error of NCCL, cuBLAS, the CUDA runtime or Triton in ``text``, or None."""
    if ALLOCATOR_MARK in text:
        return None
    for source, pattern in _EXTERNAL:
        if pattern.search(text):
            return ExternalOOM(source, text.strip()[:400])
    return None

