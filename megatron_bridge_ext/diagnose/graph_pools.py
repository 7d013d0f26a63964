"""A run's CUDA-graph private pools beside the pool the estimate's capture phase predicts.

Two artifacts measure the pools, each of one rank:

* a memory snapshot: the private segments (``segment_pool_id`` other than the default pool's, :mod:`.snapshot`) are
  the pools whole, their free blocks in them;
* PyTorch's OOM message (torch >= 2.3): only the pools' free blocks ("allocated in private pools", :mod:`.oom_text`),
  so at least that much of the pools, not their size.

The prediction is the ``CUDA-graph capture`` phase's pool for that rank's pipeline stage
(:func:`megatron_bridge_ext.estimate.phases.graph_pool`): the graphs' static buffers plus the captured regions'
intermediates, which a replay allocates in the pool. Pure: records in, rows and lines out; bytes throughout.
"""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext.sizes import gib

SNAPSHOT, OOM = "snapshot", "oom message"
PHASE = "CUDA-graph capture"


def measured(run) -> list[dict]:
    """Per rank and artifact, the private-pool bytes it shows: a snapshot's private segments (and their free blocks),
    an OOM message's free blocks in private pools; only artifacts that show some."""
    out = []
    for summary in run.snapshots:
        total = sum(d.private_pool_bytes for d in summary.devices)
        if summary.rank is not None and total:
            out.append({"rank": summary.rank, "source": SNAPSHOT, "pool_bytes": total,
                        "free_bytes": sum(d.private_pool_free_bytes for d in summary.devices)})
    for failure in run.failures:
        free = (failure.verdict.numbers or {}).get("private_pool_bytes")
        if failure.rank is not None and free:
            out.append({"rank": failure.rank, "source": OOM, "pool_bytes": None, "free_bytes": free})
    return out


def compare(run, pools: dict) -> list[dict]:
    """One row per measure of :func:`measured`, beside the predicted pool of its rank's stage (``pools``: stage ->
    :class:`~megatron_bridge_ext.estimate.phases.GraphPool` or None, every estimated stage), and the verdict. A rank
    not placed in the layout is set beside the one stage when only one was estimated."""
    rows = []
    for m in measured(run):
        coords = run.coordinates.get(m["rank"])
        stage = coords.pp if coords is not None else (next(iter(pools)) if len(pools) == 1 else None)
        pool = pools.get(stage)
        rows.append({**m, "stage": stage,
                     "predicted_pool_bytes": None if pool is None else pool.total_bytes,
                     "predicted_static_bytes": None if pool is None else pool.static_bytes,
                     "predicted_intermediate_bytes": None if pool is None else pool.intermediate_bytes,
                     "verdict": _verdict(m, pool, estimated=stage in pools)})
    return rows


def _verdict(m: dict, pool, *, estimated: bool) -> str:
    """Within or beyond the prediction, and what it means."""
    if not estimated:
        return "its pipeline stage was not estimated (the estimate gives the first of each group of alike stages)"
    if pool is None:
        return ("the estimate has no capture phase for this config (no per-layer graphs: cuda_graph_impl none or "
                "full_iteration), so nothing to set the pools beside")
    predicted = pool.total_bytes
    if m["pool_bytes"] is None:
        if m["free_bytes"] > predicted:
            return (f"beyond the prediction: the free blocks alone exceed it by {gib(m['free_bytes'] - predicted)}; "
                    "the pools hold more than the captured graphs' buffers and intermediates (graphs captured beyond "
                    "the config's cuda_graph_modules, or another MemPool user); a snapshot shows what is in them")
        return ("the message gives only the pools' free blocks, a part of the pools: not enough to say whether they "
                "are within the prediction; a snapshot at the OOM gives their size")
    if m["pool_bytes"] <= predicted:
        return (f"within the prediction ({gib(predicted - m['pool_bytes'])} to spare): the pools are what the capture "
                "phase counts, so the peak is to be cut elsewhere")
    beyond = m["pool_bytes"] - predicted
    if m["free_bytes"] >= beyond:
        return (f"beyond the prediction by {gib(beyond)}, which the pools' {gib(m['free_bytes'])} of free blocks "
                "cover: memory reserved for the graphs' replays (the captured regions' transients, the pool's "
                "fragmentation) that the default pool cannot use; fewer captured modules (cuda_graph_modules) "
                "shrink it")
    return (f"beyond the prediction by {gib(beyond)}, more than the pools' {gib(m['free_bytes'])} of free blocks: "
            "the pools hold live tensors the capture phase does not count (graphs beyond the config's "
            "cuda_graph_modules, or another MemPool user); the snapshot's allocations in private segments say whose")


def lines(rows: list[dict]) -> list[str]:
    """One sentence per row, measured and predicted named."""
    out = []
    for r in rows:
        where = f"rank {r['rank']}" + ("" if r["stage"] is None else f" (stage {r['stage']})")
        if r["source"] == SNAPSHOT:
            seen = f"measured {gib(r['pool_bytes'])} in private pools (snapshot: private segments, " \
                   f"{gib(r['free_bytes'])} of them free)"
        else:
            seen = f"measured {gib(r['free_bytes'])} free in private pools (OOM message)"
        if r["predicted_pool_bytes"] is None:
            out.append(f"CUDA-graph pools, {where}: {seen}; {r['verdict']}")
            continue
        out.append(f"CUDA-graph pools, {where}: {seen}, predicted {gib(r['predicted_pool_bytes'])} by the '{PHASE}' "
                   f"phase (static buffers {gib(r['predicted_static_bytes'])} + captured regions' intermediates "
                   f"{gib(r['predicted_intermediate_bytes'])}): {r['verdict']}")
    return out
