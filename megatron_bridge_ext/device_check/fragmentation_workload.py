"""A workload that runs out of memory from fragmentation under the default allocator, not with expandable segments.

Run each mode in its own process (the allocator reads its settings once):

    python -m megatron_bridge_ext.device_check.fragmentation_workload --mode default     # expected: OOM, fragmentation
    python -m megatron_bridge_ext.device_check.fragmentation_workload --mode expandable  # expected: completes

The cap (``torch.cuda.set_per_process_memory_fraction``) is ``BIG + HEADROOM`` bytes. Steps:
1. allocate BIG (1 GiB) and free it: the caching allocator keeps one 1 GiB segment;
2. allocate BIG / PIECE pieces of PIECE (32 MiB): all are cut from that segment;
3. free every other piece: half the segment is free, in 32 MiB holes between live pieces;
4. allocate 2 * PIECE (64 MiB): no hole is large enough, the segment cannot be released (live
   pieces), and a new 64 MiB segment exceeds the cap -> OOM with 512 MiB free inside the cap.
With expandable segments the allocator unmaps the free pages of its segment and maps new ones,
so step 4 fits; the script also checks that peak reserved memory stayed under the cap.
Prints one JSON object (``--json`` for one line); exit status 0 when the mode behaved as expected.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MiB = 1 << 20
BIG = 1024 * MiB
PIECE = 32 * MiB
HEADROOM = 48 * MiB


def stats_at_the_oom() -> dict:
    """What the default allocator's ``memory_stats()`` hold at step 4, from the steps above: one BIG
    segment reserved, half of it allocated in live pieces, the other half free in PIECE-sized split
    holes; the request is 2 * PIECE. (The device check's dry run diagnoses these on a CPU.)"""
    live = (BIG // PIECE // 2) * PIECE
    return {"allocated_bytes.all.current": live, "reserved_bytes.all.current": BIG,
            "inactive_split_bytes.all.current": BIG - live, "num_alloc_retries": 1, "num_ooms": 1,
            "request_bytes": 2 * PIECE}


def _prepare_environment(mode: str) -> dict:
    """Before torch is imported: default allocator, or ours with expandable segments."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        os.environ.pop(name, None)
    if mode == "default":
        return {}
    import megatron_bridge_ext

    return megatron_bridge_ext.init().to_dict()


def run(mode: str) -> dict:
    setup = _prepare_environment(mode)
    import torch

    from megatron_bridge_ext.levers.allocator import verify_allocator
    from megatron_bridge_ext.diagnose import classify, parse_oom_message

    if not torch.cuda.is_available():
        return {"mode": mode, "skipped": "no CUDA device", "setup": setup, "expected": False}
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = BIG + HEADROOM
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    result = {"mode": mode, "cap_bytes": cap, "total_memory": total, "setup": setup,
              "allocator_settings": torch._C._accelerator_getAllocatorSettings()
              if hasattr(torch._C, "_accelerator_getAllocatorSettings") else None}
    try:
        big = torch.empty(BIG, dtype=torch.uint8, device=device)
        del big
        pieces = [torch.empty(PIECE, dtype=torch.uint8, device=device) for _ in range(BIG // PIECE)]
        for i in range(0, len(pieces), 2):
            pieces[i] = None
        wide = torch.empty(2 * PIECE, dtype=torch.uint8, device=device)
        wide.fill_(1)
        torch.cuda.synchronize(device)
        result.update(completed=True, oom=False)
    except torch.OutOfMemoryError as error:
        stats = torch.cuda.memory_stats(device)
        parsed = parse_oom_message(str(error))
        diagnosis = classify(stats, total_memory=total, expandable_segments=mode == "expandable",
                             request_bytes=parsed["request_bytes"])
        result.update(completed=False, oom=True, error=str(error).splitlines()[0], diagnosis=diagnosis.kind,
                      full_stats=dict(stats),
                      diagnosis_headline=diagnosis.headline,
                      stats={k: stats[k] for k in ("allocated_bytes.all.current", "reserved_bytes.all.current",
                                                   "inactive_split_bytes.all.current", "num_alloc_retries",
                                                   "num_ooms")})
    result["max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    result["reserved_within_cap"] = result["max_reserved_bytes"] <= cap
    if mode == "expandable":
        result["verify"] = verify_allocator(device).to_dict()
        result["expected"] = bool(result["completed"] and result["reserved_within_cap"]
                                  and result["verify"]["in_effect"])
    else:
        result["expected"] = bool(result["oom"] and result.get("diagnosis") == "fragmentation")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_bridge_ext.device_check.fragmentation_workload",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("default", "expandable"), required=True)
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args(argv)
    result = run(args.mode)
    print(json.dumps(result, default=str) if args.json else json.dumps(result, indent=2, default=str))
    return 0 if result.get("expected") else 1


if __name__ == "__main__":
    sys.exit(main())
