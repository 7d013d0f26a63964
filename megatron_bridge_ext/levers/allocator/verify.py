"""Prove that expandable segments are in effect on the device (or report the configuration on a CPU)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, MutableMapping, Optional

from megatron_bridge_ext.levers.allocator.options import ALLOC_VAR, CUDA_VAR, effective, parse_version


@dataclass
class AllocatorVerification:
    on_device: bool  # checked on a CUDA device (else: configuration only)
    configured: Optional[bool]  # expandable_segments as the environment / torch settings say
    in_effect: Optional[bool]  # the segment holding a fresh allocation is expandable (device only)
    source: str  # where the answer comes from
    message: str
    segments: int = 0
    expandable_segments: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify_allocator(device=None, environ: Optional[MutableMapping[str, str]] = None) -> AllocatorVerification:
    """Prove expandable segments are in effect after an allocation (GPU), or report the configuration (CPU).

    On a device: allocate 4 MiB, take ``torch.cuda.memory._snapshot()``, find the segment that
    holds the allocation and read its ``is_expandable`` (torch 2.14.1 puts it on every segment;
    ``allocator_settings["expandable_segments"]`` in the same snapshot is the configured flag).
    """
    env = os.environ if environ is None else environ
    import torch

    name, conf = effective(env, parse_version(torch.__version__))
    configured = bool(conf.flag("expandable_segments"))
    where = f"{name}={env[name]!r}" if name else f"neither {CUDA_VAR} nor {ALLOC_VAR} set"
    if not torch.cuda.is_available():
        return AllocatorVerification(
            False, configured, None, "environment",
            f"not verified on a device (no CUDA device): configured expandable_segments={configured} from {where}")
    backend = torch.cuda.memory.get_allocator_backend()
    if backend != "native":
        return AllocatorVerification(
            True, False, False, "torch.cuda.memory.get_allocator_backend",
            f"allocator backend is {backend!r}: it has no expandable segments")
    probe = torch.empty(4 << 20, dtype=torch.uint8, device=device if device is not None else "cuda")
    try:
        snapshot = torch.cuda.memory._snapshot(probe.device)
        settings = snapshot.get("allocator_settings", {})
        configured = bool(settings.get("expandable_segments", configured))
        ptr = probe.data_ptr()
        segments = [s for s in snapshot["segments"] if s.get("device", probe.device.index) == probe.device.index]
        holder = next((s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"]), None)
    finally:
        del probe
    if holder is None or "is_expandable" not in holder:
        return AllocatorVerification(
            True, configured, None, "torch.cuda.memory._snapshot()['allocator_settings']",
            "could not find the segment holding the probe allocation (or its is_expandable field) in the snapshot; "
            f"allocator_settings says expandable_segments={configured}", len(segments))
    in_effect = bool(holder["is_expandable"])
    count = sum(bool(s.get("is_expandable")) for s in segments)
    return AllocatorVerification(
        True, configured, in_effect, "torch.cuda.memory._snapshot() segment is_expandable",
        f"expandable segments {'in effect' if in_effect else 'NOT in effect'}: the segment holding a fresh 4 MiB "
        f"allocation has is_expandable={in_effect} ({count} of {len(segments)} segments expandable)",
        len(segments), count)
