"""Memory snapshots built from torch's documented structure, since ``torch.cuda.memory._snapshot()`` needs CUDA.

Source: the ``_snapshot`` docstring of torch/cuda/memory.py in torch 2.14.1 (Snapshot line 1051, Segment
1056, Block 1075, Frame 1091, TraceEntry 1102), and the dictionaries torch/csrc/cuda/Module.cpp
(``THCPModule_memorySnapshot``) fills: per segment ``device`` and ``is_expandable``, block addresses that
run on from the segment's (``address += blockInfo.size``), the state name ``active_pending_free``, an
``oom`` entry with ``device_free`` in place of ``addr``, and ``allocator_settings`` with the keys of
torch 2.14.1 (``PYTORCH_CUDA_ALLOC_CONF``, ``max_split_size``, ..., ``expandable_segments``).
"""

from __future__ import annotations

import gzip
import itertools
import pickle
from typing import Iterable, Optional

MiB, GiB = 1 << 20, 1 << 30
_addresses = itertools.count(0x7F0000000000, 1 << 36)


def frame(filename: str, line: int, name: str = "forward") -> dict:
    """memory.py:1091 Frame: filename, line, name."""
    return {"filename": filename, "line": line, "name": name}


def block(size: int, state: str = "active_allocated", frames: Iterable[dict] = ()) -> dict:
    """memory.py:1075 Block (``address`` is set by :func:`segment`, as Module.cpp does)."""
    return {"size": size, "requested_size": size, "state": state, "frames": list(frames)}


def segment(blocks: list[dict], *, device: int = 0, pool_id: tuple = (0, 0), stream: int = 0,
            is_expandable: bool = False) -> dict:
    """memory.py:1056 Segment; total, allocated and active sizes summed from the blocks as the allocator
    reports them (allocated: active_allocated; active: allocated or awaiting free)."""
    address = next(_addresses)
    placed, offset = [], address
    for b in blocks:
        placed.append(dict(b, address=offset))
        offset += b["size"]
    sizes = {state: sum(b["size"] for b in blocks if b["state"] == state) for state in {b["state"] for b in blocks}}
    allocated = sizes.get("active_allocated", 0)
    return {"device": device, "address": address, "total_size": offset - address, "allocated_size": allocated,
            "active_size": allocated + sizes.get("active_pending_free", 0) + sizes.get("active_awaiting_free", 0),
            "requested_size": allocated, "stream": stream, "segment_type": "large", "segment_pool_id": pool_id,
            "is_expandable": is_expandable, "frames": [], "blocks": placed}


def alloc(size: int, addr: int = 0) -> dict:
    """memory.py:1102 TraceEntry of action ``alloc``."""
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": []}


def oom(size: int, device_free: int) -> dict:
    """memory.py:1116/1129 TraceEntry of action ``oom``: ``size`` requested, ``device_free`` instead of ``addr``."""
    return {"action": "oom", "device_free": device_free, "size": size, "stream": 0, "frames": []}


def allocator_settings(expandable_segments: bool) -> dict:
    """Module.cpp's ``allocator_settings`` dictionary (torch 2.14.1 keys)."""
    conf = "expandable_segments:True" if expandable_segments else ""
    return {"PYTORCH_CUDA_ALLOC_CONF": conf, "max_split_size": -1, "garbage_collection_threshold": 0.0,
            "expandable_segments": expandable_segments, "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False, "pinned_use_cuda_host_register": False,
            "roundup_power2_divisions": {"1": 0}, "graph_capture_record_stream_reuse": False}


def snapshot(segments: list[dict], traces: Optional[dict[int, list[dict]]] = None,
             settings: Optional[dict] = None) -> dict:
    """memory.py:1051 Snapshot; ``traces`` maps a device to its entries (``device_traces`` is indexed by device)."""
    traces = traces or {}
    devices = max([s["device"] for s in segments] + list(traces), default=-1) + 1
    data = {"segments": segments, "device_traces": [traces.get(d, []) for d in range(devices)]}
    if settings is not None:
        data["allocator_settings"] = settings
    return data


def dump(data, path, compress: bool = False) -> str:
    """As ``torch.cuda.memory._dump_snapshot`` writes it (``pickle.dump``), optionally gzip-compressed."""
    with (gzip.open if compress else open)(path, "wb") as handle:
        pickle.dump(data, handle)
    return str(path)
