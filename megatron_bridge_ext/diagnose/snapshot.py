"""Read a PyTorch memory snapshot and say, from its blocks, whether the out-of-memory error was fragmentation.

One loader, several small views, as torch/cuda/_memory_viz.py reads a snapshot: :func:`read_snapshot`
unpickles with :mod:`.safe_pickle` (nothing in the file runs), :func:`_records` turns the dictionary into
plain records, checking each field's type, and :func:`summarize` derives one :class:`DeviceSummary` per
device from those records alone.

The structure is the ``_snapshot`` docstring of torch/cuda/memory.py (torch 2.14.1, lines 1051-1135):
``segments`` (one per cudaMalloc: ``device``, ``address``, ``total_size``, ``stream``,
``segment_pool_id``, ``blocks``), each block with ``size``, ``state`` and ``frames`` (innermost call
first), and ``device_traces`` (one list of trace entries per device; an ``oom`` entry carries ``size``,
the request, and ``device_free``). Newer torch adds ``allocator_settings`` and per-segment
``is_expandable`` (torch/csrc/cuda/Module.cpp, ``THCPModule_memorySnapshot``). The docstring names the
block state ``active_awaiting_free`` while that C++ code emits ``active_pending_free``: both are read as
one state. ``torch.cuda.memory_snapshot()`` returns the segments alone, a list, which _memory_viz.py's
reader also takes; it is read as a snapshot without traces.

Why the blocks decide: c10/cuda/CUDACachingAllocator.cpp ``malloc`` raises only after no free block
of the pool held the rounded request and a new segment failed even after every whole free segment
was released; it then records the ``oom`` entry (``params.size()``, the rounded request, and
cudaMemGetInfo's free bytes) before calling the OOM observers that dump the snapshot (Bridge's and
Megatron-LM's). So at that snapshot the free blocks are exactly the free memory the allocator could not
use. Fragmentation is *shown* when the request fits in the summed free memory (free in segments plus
``device_free``) but in no single free block; it is *ruled out* when the request is larger than all free
memory. When ``device_free`` alone would hold the request, cudaMalloc was refused by a limit (the
per-process memory fraction), so only the free memory inside segments counts.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, BinaryIO, Mapping, Optional

from megatron_bridge_ext.diagnose.classifier import fmt_bytes
from megatron_bridge_ext.diagnose.safe_pickle import load

ALLOCATED, AWAITING_FREE, INACTIVE = "active_allocated", "active_awaiting_free", "inactive"
STATES = {ALLOCATED: ALLOCATED, AWAITING_FREE: AWAITING_FREE, "active_pending_free": AWAITING_FREE,
          INACTIVE: INACTIVE}
"""Block states as written (the docstring's and the C++ code's names) -> one name each."""
DEFAULT_POOL = (0, 0)
"""``segment_pool_id`` of the default pool; any other id is a private pool (CUDA graphs, MemPool)."""
RECORDED_MAX_ENTRIES = 100_000
"""The ``trace_alloc_max_entries`` Bridge (megatron/bridge/training/utils/train_utils.py:214, 0.6.2) and
Megatron-LM (megatron/training/utils/utils.py:36, model_provider.py:41) record history with. The
snapshot does not record its ring buffer's size (no key of ``allocator_settings`` holds it, torch 2.14.1),
so a trace of exactly this many entries is taken as a full buffer whose oldest events were overwritten."""
TOP_GROUPS = 8
"""How many allocation sites :attr:`DeviceSummary.top_allocations` keeps."""
_FRAMEWORK = re.compile(r"(?:^|/)((?:megatron|transformer_engine)/.*)$")
_RANK_PATTERNS = (
    re.compile(r"^oom_rank(\d+)\.snapshot\.pickle$"),  # ours: diagnose/handler.py, oom_rank<N>.snapshot.pickle
    re.compile(r"^oom_rank-(\d+)_"),  # Megatron-LM model_provider.py:50, oom_rank-{rank}_{memory_snapshot_path}
    re.compile(r"_oom_rank[-_](\d+)(?:\.[^.]*)?$"),  # Bridge train_utils.py:225 {base}_oom_rank-{rank}{ext};
    # Megatron-LM megatron/training/utils/utils.py:47 {base}_oom_rank_{rank}{ext}
    re.compile(r"_(\d+)(?:\.[^.]*)?$"),  # Bridge train_utils.py:840, Megatron-LM training.py:3544 {base}_{rank}{ext}
)


def is_pickle(first_bytes: bytes) -> bool:
    """Whether bytes start like a pickle of protocol 2 to 5 (the PROTO opcode, 0x80, then the protocol)."""
    return len(first_bytes) >= 2 and first_bytes[0] == 0x80 and 2 <= first_bytes[1] <= 5


def rank_from_name(name: str) -> Optional[int]:
    """The global rank in a per-rank snapshot's file name (see :data:`_RANK_PATTERNS` for whose names), or None.
    A trailing ``.gz`` is ignored; so is the folder."""
    base = os.path.basename(name)
    base = base[:-3] if base.endswith(".gz") else base
    for pattern in _RANK_PATTERNS:
        match = pattern.search(base)
        if match:
            return int(match.group(1))
    return None


# ------------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    filename: str
    line: int
    name: str


@dataclass(frozen=True)
class Block:
    size: int
    state: str  # one of ALLOCATED, AWAITING_FREE, INACTIVE
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class Segment:
    device: int
    total_size: int
    pool_id: tuple[int, int]
    is_expandable: Optional[bool]
    blocks: tuple[Block, ...]

    @property
    def private(self) -> bool:
        return self.pool_id != DEFAULT_POOL


@dataclass(frozen=True)
class OomEntry:
    request_bytes: int
    device_free_bytes: int


@dataclass(frozen=True)
class Trace:
    device: int
    entries: int
    ooms: tuple[OomEntry, ...]


class _Fields:
    """Typed reads of one dictionary of the snapshot; errors name the file and the field's path."""

    def __init__(self, name: str, path: str, value: Any):
        if not isinstance(value, dict):
            raise ValueError(f"{name}: {path} is a {type(value).__name__}; a memory snapshot holds a dictionary there")
        self.name, self.path, self.value = name, path, value

    def get(self, key: str, kinds: tuple, default: Any = ...) -> Any:
        if key not in self.value:
            if default is not ...:
                return default
            raise ValueError(f"{self.name}: {self.path} has no {key!r}; expected a memory snapshot of "
                             "torch.cuda.memory._dump_snapshot")
        value = self.value[key]
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            expected = " or ".join(kind.__name__ for kind in kinds)
            raise ValueError(f"{self.name}: {self.path}.{key} is {_short(value)}; a memory snapshot holds {expected} there")
        return value

    def size(self, key: str) -> int:
        value = self.get(key, (int,))
        if value < 0:
            raise ValueError(f"{self.name}: {self.path}.{key} is {value}; a memory snapshot holds a byte count >= 0 there")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _records(data: Any, name: str) -> tuple[tuple[Segment, ...], tuple[Trace, ...], dict]:
    """Segments, per-device traces and allocator settings, every field checked; ValueError naming the field."""
    if isinstance(data, list):  # torch.cuda.memory_snapshot(): the segments only
        data = {"segments": data}
    if not isinstance(data, dict) or not ("segments" in data or "device_traces" in data):
        raise ValueError(f"{name}: a pickle but not a memory snapshot: expected a dictionary with 'segments' and "
                         "'device_traces' (torch.cuda.memory._dump_snapshot)")
    top = _Fields(name, "snapshot", data)
    segments = tuple(_segment(name, f"segments[{i}]", s) for i, s in enumerate(top.get("segments", (list,), [])))
    traces = tuple(_trace(name, device, t) for device, t in enumerate(top.get("device_traces", (list,), [])))
    return segments, traces, top.get("allocator_settings", (dict,), {})


def _segment(name: str, path: str, value: Any) -> Segment:
    fields = _Fields(name, path, value)
    pool = fields.get("segment_pool_id", (tuple, list))
    if len(pool) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) for p in pool):
        raise ValueError(f"{name}: {path}.segment_pool_id is {_short(pool)}; a memory snapshot holds two integers there")
    blocks = tuple(_block(name, f"{path}.blocks[{i}]", b) for i, b in enumerate(fields.get("blocks", (list,))))
    return Segment(fields.get("device", (int,)), fields.size("total_size"), (pool[0], pool[1]),
                   fields.get("is_expandable", (bool,), None), blocks)


def _block(name: str, path: str, value: Any) -> Block:
    fields = _Fields(name, path, value)
    state = fields.get("state", (str,))
    if state not in STATES:
        raise ValueError(f"{name}: {path}.state is {state!r}; a memory snapshot holds one of {sorted(STATES)} there")
    return Block(fields.size("size"), STATES[state], _frames(name, path, fields))


def _frames(name: str, path: str, fields: _Fields) -> tuple[Frame, ...]:
    frames = []
    for i, value in enumerate(fields.get("frames", (list,), [])):
        frame = _Fields(name, f"{path}.frames[{i}]", value)
        frames.append(Frame(frame.get("filename", (str,)), frame.get("line", (int,)), frame.get("name", (str,))))
    return tuple(frames)


def _trace(name: str, device: int, entries: Any) -> Trace:
    if not isinstance(entries, list):
        raise ValueError(f"{name}: device_traces[{device}] is {_short(entries)}; a memory snapshot holds a list of "
                         "trace entries there")
    ooms = []
    for i, value in enumerate(entries):
        entry = _Fields(name, f"device_traces[{device}][{i}]", value)
        if entry.get("action", (str,)) == "oom":
            ooms.append(OomEntry(entry.size("size"), entry.size("device_free")))
    return Trace(device, len(entries), tuple(ooms))


# ------------------------------------------------------------------------------------------------
# Analysis
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllocationGroup:
    """Live blocks whose innermost Megatron (Core, Bridge, training) or Transformer Engine frame is ``site``."""
    site: str  # "megatron/core/...py:123", or a bracketed reason when no such frame was recorded
    function: str
    bytes: int
    count: int


@dataclass(frozen=True)
class RingBuffer:
    entries: int
    full: Optional[bool]  # None: more entries than RECORDED_MAX_ENTRIES, recorded with another limit
    reason: str


@dataclass(frozen=True)
class Verdict:
    kind: str  # "fragmentation" | "capacity" | "cuda-graph pools" | "unknown"
    fragmentation: str  # "shown" | "ruled out" | "undecided"
    reason: str
    numbers: Mapping[str, int]


@dataclass(frozen=True)
class DeviceSummary:
    device: int
    reserved_bytes: int
    allocated_bytes: int
    active_awaiting_free_bytes: int
    inactive_split_bytes: int
    free_bytes: int
    largest_free_block_bytes: int
    private_pool_bytes: int
    private_pool_free_bytes: int
    segment_count: int
    expandable_segments: Optional[bool]
    expandable_source: str
    oom: Optional[OomEntry]
    oom_count: int
    ring_buffer: Optional[RingBuffer]  # None: no trace (memory history was not recorded)
    top_allocations: tuple[AllocationGroup, ...]
    verdict: Verdict
    segments: tuple[Segment, ...] = field(repr=False, compare=False)  # for the picture; not in to_dict()


@dataclass(frozen=True)
class SnapshotSummary:
    name: str
    rank: Optional[int]
    devices: tuple[DeviceSummary, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: every figure in bytes (ints); the segments' blocks are left out."""
        devices = []
        for device in self.devices:
            row = asdict(replace(device, segments=()))
            del row["segments"]
            devices.append(row)
        return {"name": self.name, "rank": self.rank, "devices": devices}

    def lines(self) -> list[str]:
        """What ``mbx diagnose`` prints: a headline per device, then its evidence."""
        who = f"rank {self.rank}" if self.rank is not None else self.name
        out = []
        for device in self.devices:
            out.append(f"snapshot {who}, device {device.device}: {_headline(device.verdict)}")
            out += [f"  {line}" for line in _evidence(device)]
        return out


def read_snapshot(fileobj: BinaryIO, name: str) -> SnapshotSummary:
    """The summary of the snapshot in ``fileobj`` (already decompressed, read as a stream); ``name`` is the
    file name for errors and for the rank. Bad input: ValueError ``"{name}: ..."``, one line."""
    return summarize(load(fileobj, name), name)


def summarize(data: Any, name: str) -> SnapshotSummary:
    """The summary of a snapshot dictionary (``torch.cuda.memory._snapshot()``)."""
    segments, traces, settings = _records(data, name)
    expandable = settings.get("expandable_segments")
    if expandable is not None and not isinstance(expandable, bool):
        raise ValueError(f"{name}: allocator_settings.expandable_segments is {_short(expandable)}; a memory snapshot "
                         "holds a bool there")
    by_device = {t.device: t for t in traces if t.entries}
    devices = sorted({s.device for s in segments} | set(by_device))
    if not devices:
        raise ValueError(f"{name}: the snapshot holds no segment and no trace entry: nothing was allocated when it "
                         "was taken (before the first CUDA allocation, or after torch.cuda.empty_cache()), and memory "
                         "history was not recorded. Fix: call torch.cuda.memory._record_memory_history() at start-up "
                         "and dump the snapshot at the OOM (OOMHandler does both)")
    summaries = tuple(_device(d, [s for s in segments if s.device == d], by_device.get(d), expandable)
                      for d in devices)
    return SnapshotSummary(name, rank_from_name(name), summaries)


def _device(device: int, segments: list[Segment], trace: Optional[Trace], expandable: Optional[bool]) -> DeviceSummary:
    blocks = [(s, b) for s in segments for b in s.blocks]
    free = [b.size for s, b in blocks if b.state == INACTIVE]
    on, source = _expandable(segments, expandable)
    summary = dict(
        device=device, reserved_bytes=sum(s.total_size for s in segments),
        allocated_bytes=sum(b.size for _, b in blocks if b.state == ALLOCATED),
        active_awaiting_free_bytes=sum(b.size for _, b in blocks if b.state == AWAITING_FREE),
        inactive_split_bytes=sum(b.size for s, b in blocks if b.state == INACTIVE and len(s.blocks) > 1),
        free_bytes=sum(free), largest_free_block_bytes=max(free, default=0),
        private_pool_bytes=sum(s.total_size for s in segments if s.private),
        private_pool_free_bytes=sum(b.size for s, b in blocks if s.private and b.state == INACTIVE),
        segment_count=len(segments), expandable_segments=on, expandable_source=source,
        oom=trace.ooms[-1] if trace and trace.ooms else None, oom_count=len(trace.ooms) if trace else 0,
        ring_buffer=_ring_buffer(trace.entries) if trace else None,
        top_allocations=_groups([b for _, b in blocks if b.state == ALLOCATED]), segments=tuple(segments))
    return DeviceSummary(**summary, verdict=_verdict(summary))


def _expandable(segments: list[Segment], setting: Optional[bool]) -> tuple[Optional[bool], str]:
    """From ``allocator_settings`` when the snapshot has it, else from the segments' ``is_expandable`` (only the
    default pool's segments become expandable, Module.cpp / CUDACachingAllocator.cpp ``malloc``)."""
    if setting is not None:
        return setting, "allocator_settings"
    if any(s.is_expandable for s in segments):
        return True, "an expandable segment"
    default = [s for s in segments if not s.private]
    if default and all(s.is_expandable is False for s in default):
        return False, "no segment is expandable"
    return None, "not recorded"


def _ring_buffer(entries: int) -> RingBuffer:
    limit = f"{RECORDED_MAX_ENTRIES:,}"
    if entries == RECORDED_MAX_ENTRIES:
        return RingBuffer(entries, True, f"full: {limit} entries is the max_entries Bridge and Megatron-LM record "
                                         "with, so older events were overwritten and history is missing")
    if entries > RECORDED_MAX_ENTRIES:
        return RingBuffer(entries, None, f"recorded with a max_entries above {limit}; the snapshot does not say "
                                         "which, so whether it was full is unknown")
    return RingBuffer(entries, False, f"not full: fewer than the {limit} entries Bridge and Megatron-LM keep "
                                      "(the snapshot does not record max_entries; a smaller one set by hand is "
                                      "full at exactly its count)")


def _groups(live: list[Block]) -> tuple[AllocationGroup, ...]:
    groups: dict[tuple[str, str], list[int]] = {}
    for block in live:
        key = _site(block.frames)
        sizes = groups.setdefault(key, [0, 0])
        sizes[0] += block.size
        sizes[1] += 1
    ranked = sorted(groups.items(), key=lambda item: (-item[1][0], item[0]))
    return tuple(AllocationGroup(site, function, size, count) for (site, function), (size, count) in ranked[:TOP_GROUPS])


def _site(frames: tuple[Frame, ...]) -> tuple[str, str]:
    """The innermost frame (frames run innermost first, as _memory_viz.py's flame graph reverses them) in
    Megatron's or Transformer Engine's sources, as (path from the package folder:line, function)."""
    if not frames:
        return "[no stack recorded]", ""
    for frame in frames:
        match = _FRAMEWORK.search(frame.filename)
        if match:
            return f"{match.group(1)}:{frame.line}", frame.name
    return "[no Megatron, Bridge or TE frame]", ""


def _verdict(s: dict) -> Verdict:
    """Fragmentation shown, ruled out or undecided, from the blocks and the ``oom`` entry (module docstring)."""
    largest, free, private_free = s["largest_free_block_bytes"], s["free_bytes"], s["private_pool_free_bytes"]
    oom = s["oom"]
    if oom is None:
        why = "no trace: memory history was not recorded" if s["ring_buffer"] is None else \
            "the snapshot was not taken at an out-of-memory error"
        return Verdict("unknown", "undecided", f"no oom entry ({why}); a request up to the largest free block, "
                       f"{fmt_bytes(largest)}, fits without a new segment; {fmt_bytes(free)} is free in segments",
                       {"largest_free_block_bytes": largest, "free_in_segments_bytes": free})
    request, device_free = oom.request_bytes, oom.device_free_bytes
    usable = free - private_free  # the default pool cannot place a request in a private pool's blocks
    numbers = {"request_bytes": request, "device_free_bytes": device_free, "free_in_segments_bytes": usable,
               "private_pool_free_bytes": private_free, "largest_free_block_bytes": largest,
               "private_pool_bytes": s["private_pool_bytes"], "free_total_bytes": free + device_free}
    req = f"the {fmt_bytes(request)} request"
    if request > free + device_free:
        held = s["private_pool_bytes"] - private_free
        if held and request <= free + device_free + held:
            return Verdict("cuda-graph pools", "ruled out", f"{req} is larger than all free memory "
                           f"({fmt_bytes(free + device_free)}), but private pools (CUDA graphs) hold {fmt_bytes(held)} "
                           "allocated, enough to place it", numbers)
        return Verdict("capacity", "ruled out", f"{req} is larger than all free memory, {fmt_bytes(free + device_free)} "
                       f"({fmt_bytes(free)} in segments + {fmt_bytes(device_free)} device free)", numbers)
    if request <= largest:
        return Verdict("unknown", "undecided", f"a free block of {fmt_bytes(largest)} would hold {req}, yet the "
                       "allocator raised: it lies on another stream or in a private pool, or is an oversize block "
                       "(max_split_size)", numbers)
    if device_free >= request:
        return _limited(req, request, usable, largest, device_free, numbers)
    if request <= usable + device_free:
        return Verdict("fragmentation", "shown", f"{req} fits in the {fmt_bytes(usable + device_free)} free "
                       f"({fmt_bytes(usable)} in segments + {fmt_bytes(device_free)} device free) but in no single free "
                       f"block (the largest is {fmt_bytes(largest)})", numbers)
    return Verdict("cuda-graph pools", "ruled out", f"{req} fits only counting the {fmt_bytes(private_free)} free inside "
                   "private pools (CUDA graphs), which the default pool cannot use", numbers)


def _limited(req: str, request: int, usable: int, largest: int, device_free: int, numbers: dict) -> Verdict:
    """The device had room, so a limit (set_per_process_memory_fraction) refused the new segment: only the
    free memory inside segments counts."""
    limit = f"the device had {fmt_bytes(device_free)} free, so a memory fraction limit refused the new segment"
    if request <= usable:
        return Verdict("fragmentation", "shown", f"{req} fits in the {fmt_bytes(usable)} free in segments but in no "
                       f"single free block (the largest is {fmt_bytes(largest)}); {limit}", numbers)
    return Verdict("unknown", "undecided", f"{limit}; the {fmt_bytes(usable)} free in segments would not hold {req}: "
                   "raise the limit", numbers)


def _headline(verdict: Verdict) -> str:
    if verdict.kind == "fragmentation":
        return f"fragmentation shown: {verdict.reason}"
    if verdict.kind == "capacity":
        return f"capacity, fragmentation ruled out: {verdict.reason}"
    if verdict.kind == "cuda-graph pools":
        return f"CUDA-graph pools: {verdict.reason}"
    return f"unknown: {verdict.reason}"


def _evidence(d: DeviceSummary) -> list[str]:
    lines = [f"reserved {fmt_bytes(d.reserved_bytes)} in {d.segment_count} segment(s), "
             f"{fmt_bytes(d.private_pool_bytes)} of it in private pools; allocated {fmt_bytes(d.allocated_bytes)}; "
             f"active awaiting free {fmt_bytes(d.active_awaiting_free_bytes)}",
             f"free in segments {fmt_bytes(d.free_bytes)} ({fmt_bytes(d.inactive_split_bytes)} of it in split "
             f"blocks); largest free block {fmt_bytes(d.largest_free_block_bytes)}"]
    if d.oom:
        lines.append(f"oom entry: request {fmt_bytes(d.oom.request_bytes)}, device free "
                     f"{fmt_bytes(d.oom.device_free_bytes)}" + (f" (last of {d.oom_count})" if d.oom_count > 1 else ""))
    state = {True: "on", False: "off", None: "unknown"}[d.expandable_segments]
    lines.append(f"expandable segments: {state} ({d.expandable_source})")
    if d.ring_buffer:
        count = d.ring_buffer.entries
        lines.append(f"trace: {count:,} {'entry' if count == 1 else 'entries'}, ring buffer {d.ring_buffer.reason}")
    else:
        lines.append("trace: none (memory history was not recorded)")
    for group in d.top_allocations:
        where = f"{group.site} {group.function}".rstrip()
        lines.append(f"live: {fmt_bytes(group.bytes)} in {group.count} block(s) from {where}")
    return lines
