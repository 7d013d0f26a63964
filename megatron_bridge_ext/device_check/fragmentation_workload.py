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
With ``--keep DIR`` it records memory history while it runs and, at the OOM, keeps what a user would
have: the real snapshot (``torch.cuda.memory._dump_snapshot``) as DIR/:data:`SNAPSHOT` and the real OOM
message (``str(error)``) as DIR/:data:`MESSAGE`.
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
SNAPSHOT = "fragmentation_snapshot.pickle"
MESSAGE = "fragmentation_oom_message.txt"
HISTORY_ENTRIES = 10_000
"""``max_entries`` of the recorded history: the workload makes about a hundred allocator events, so the
ring buffer never wraps and the snapshot holds the whole run."""


def stats_at_the_oom() -> dict:
    """What the default allocator's ``memory_stats()`` hold at step 4, from the steps above: one BIG
    segment reserved, half of it allocated in live pieces, the other half free in PIECE-sized split
    holes; the request is 2 * PIECE. (The device check's dry run diagnoses these on a CPU.)"""
    live = (BIG // PIECE // 2) * PIECE
    return {"allocated_bytes.all.current": live, "reserved_bytes.all.current": BIG,
            "inactive_split_bytes.all.current": BIG - live, "num_alloc_retries": 1, "num_ooms": 1,
            "request_bytes": 2 * PIECE}


def snapshot_at_the_oom() -> dict:
    """The snapshot the default allocator holds at step 4, from the steps above, in the structure of
    torch/cuda/memory.py's ``_snapshot`` docstring (torch 2.14.1, lines 1051-1135): one BIG segment of
    PIECE blocks, the even ones freed (inactive), the odd ones live; the trace's ``oom`` entry requests
    2 * PIECE. (The device check's dry run reads it on a CPU.)"""
    states = ["inactive" if i % 2 == 0 else "active_allocated" for i in range(BIG // PIECE)]
    blocks = [{"address": i * PIECE, "size": PIECE, "requested_size": PIECE, "state": state, "frames": []}
              for i, state in enumerate(states)]
    segment = {"device": 0, "address": 0, "total_size": BIG, "allocated_size": BIG // 2, "active_size": BIG // 2,
               "requested_size": BIG // 2, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
               "is_expandable": False, "frames": [], "blocks": blocks}
    oom = {"action": "oom", "device_free": 64 * BIG, "size": 2 * PIECE, "stream": 0,  # any GPU has more than
           "frames": []}  # the cap free: the memory fraction, not the device, refused the new segment
    return {"segments": [segment], "device_traces": [[oom]], "allocator_settings": {"expandable_segments": False}}


def _keep(torch, keep: str, error: BaseException) -> dict:
    """The real snapshot and OOM message, written where the device check reads them."""
    snapshot, message = os.path.join(keep, SNAPSHOT), os.path.join(keep, MESSAGE)
    torch.cuda.memory._dump_snapshot(snapshot)
    with open(message, "w") as handle:
        handle.write(str(error) + "\n")
    return {"snapshot": snapshot, "message": message}


def _prepare_environment(mode: str) -> dict:
    """Before torch is imported: default allocator, or ours with expandable segments."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        os.environ.pop(name, None)
    if mode == "default":
        return {}
    import megatron_bridge_ext

    return megatron_bridge_ext.init().to_dict()


def run(mode: str, keep: str | None = None) -> dict:
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
    if keep:
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
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
        if keep:
            result["kept"] = _keep(torch, keep, error)
        parsed = parse_oom_message(str(error))
        diagnosis = classify(stats, total_memory=total, expandable_segments=mode == "expandable",
                             request_bytes=parsed["request_bytes"])
        result.update(completed=False, oom=True, error=str(error).splitlines()[0], diagnosis=diagnosis.kind,
                      full_stats=dict(stats),
                      diagnosis_headline=diagnosis.headline,
                      stats={k: stats[k] for k in ("allocated_bytes.all.current", "reserved_bytes.all.current",
                                                   "inactive_split_bytes.all.current", "num_alloc_retries",
                                                   "num_ooms")})
    if keep:
        torch.cuda.memory._record_memory_history(enabled=None)
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
    parser.add_argument("--keep", metavar="DIR", help=f"record memory history; at the OOM write {SNAPSHOT} and "
                                                      f"{MESSAGE} into DIR (made if missing)")
    args = parser.parse_args(argv)
    if args.keep:
        if os.path.exists(args.keep) and not os.path.isdir(args.keep):
            parser.error(f"--keep {args.keep}: not a folder; give the folder the snapshot and message go to")
        os.makedirs(args.keep, exist_ok=True)
    result = run(args.mode, args.keep)
    print(json.dumps(result, default=str) if args.json else json.dumps(result, indent=2, default=str))
    return 0 if result.get("expected") else 1


if __name__ == "__main__":
    sys.exit(main())
