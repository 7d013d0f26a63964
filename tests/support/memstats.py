"""Build ``torch.cuda.memory_stats()``-shaped dictionaries by hand, with torch's real key names.

Keys: ``{allocation,segment,active,inactive_split}`` (counts) and ``{allocated,reserved,active,
inactive_split,requested}_bytes`` (bytes), each ``.{all,large_pool,small_pool}.{current,peak,
allocated,freed}``; ``oversize_{allocations,segments}.{current,peak,allocated,freed}``; and the
counters ``num_alloc_retries``, ``num_ooms``, ``num_sync_all_streams``, ``num_device_alloc``,
``num_device_free``, ``num_oom_rejections``, ``max_split_size`` (-1: no limit).
The numbers are consistent (all = large + small, allocated - freed = current, peak >= current).
"""

from __future__ import annotations

MiB = 1 << 20
GiB = 1 << 30
POOLS = ("all", "large_pool", "small_pool")


def _stat(prefix: str, large: int, small: int, *, history: int = 3) -> dict[str, int]:
    out = {}
    for pool, current in (("large_pool", large), ("small_pool", small), ("all", large + small)):
        allocated = current * history + 17 * MiB if prefix.endswith("bytes") else current * history + 5
        out[f"{prefix}.{pool}.current"] = current
        out[f"{prefix}.{pool}.peak"] = current
        out[f"{prefix}.{pool}.allocated"] = allocated
        out[f"{prefix}.{pool}.freed"] = allocated - current
    return out


def memory_stats(*, allocated: int, reserved: int, inactive_split: int, retries: int = 0, ooms: int = 1,
                 small_reserved: int = 40 * MiB, small_allocated: int = 31 * MiB, blocks: int = 900,
                 segments: int = 120) -> dict[str, int]:
    assert allocated <= reserved and inactive_split <= reserved - allocated
    small_inactive = min(3 * MiB, inactive_split)
    stats: dict[str, int] = {}
    stats.update(_stat("allocated_bytes", allocated - small_allocated, small_allocated))
    stats.update(_stat("requested_bytes", allocated - small_allocated - 3 * MiB, small_allocated - 1 * MiB))
    stats.update(_stat("active_bytes", allocated - small_allocated, small_allocated))
    stats.update(_stat("reserved_bytes", reserved - small_reserved, small_reserved))
    stats.update(_stat("inactive_split_bytes", inactive_split - small_inactive, small_inactive))
    stats.update(_stat("allocation", blocks - 300, 300))
    stats.update(_stat("active", blocks - 300, 300))
    stats.update(_stat("segment", segments - small_reserved // (2 * MiB), small_reserved // (2 * MiB)))
    stats.update(_stat("inactive_split", max(inactive_split // (64 * MiB), 1), 4))
    for name in ("oversize_allocations", "oversize_segments"):
        for metric in ("current", "peak", "allocated", "freed"):
            stats[f"{name}.{metric}"] = 0
    stats.update({"num_alloc_retries": retries, "num_ooms": ooms, "num_sync_all_streams": 0,
                  "num_device_alloc": segments + retries, "num_device_free": retries, "num_oom_rejections": 0,
                  "max_split_size": -1})
    return dict(sorted(stats.items()))


def fragmentation_stats() -> dict[str, int]:
    """A rank of an 80 GB GPU at an OOM: 22.6 GiB reserved but unallocated, most of it in split blocks."""
    return memory_stats(allocated=52 * GiB, reserved=74 * GiB + 614 * MiB, inactive_split=21 * GiB + 307 * MiB,
                        retries=4)


def capacity_stats() -> dict[str, int]:
    """A rank of an 80 GB GPU at an OOM: live tensors fill the device, almost nothing cached."""
    return memory_stats(allocated=76 * GiB + 922 * MiB, reserved=77 * GiB + 614 * MiB, inactive_split=410 * MiB,
                        retries=1)
