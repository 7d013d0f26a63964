"""A log's memory reports beside the estimate of the same phase and stage, and the parts of the gap the artifacts show.

Each report line Bridge prints (``[Rank r] (after i iterations) memory (GB)``) is matched with the
estimate's prediction for that iteration and that rank's pipeline stage
(:func:`megatron_bridge_ext.estimate.phases.predicted_reports`: the phase whose peak the line's
``mem-max-allocated`` shows). The gap measured - predicted is set beside what the same run shows
of memory the estimate does not count as allocated:

* reserved - allocated of the same report (``mem-max-reserved`` - ``mem-max-allocated``): the caching
  allocator's slack, not in max allocated but in what the device must hold;
* the private pools of that rank's OOM message (CUDA graphs);
* that rank's process memory (``Including non-PyTorch memory, this process has ...``) - reserved: the
  CUDA context, NCCL, library workspaces.

Pure: records in, rows out; bytes throughout, GiB in the text.
"""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext import sizes


def _prediction(predictions, iteration: int, rank: int, stage: Optional[int]):
    same = [p for p in predictions if p.iteration == iteration]
    by_rank = [p for p in same if rank in p.ranks]
    return (by_rank or [p for p in same if p.stage == stage] or [None])[0]


def compare(run, predictions) -> list[dict]:
    """One row per report line of the run: measured beside predicted, the gap and its parts the artifacts show."""
    oom = {f.rank: f.verdict.numbers for f in run.failures if f.rank is not None}
    rows = []
    for rank, reports in sorted(run.reports.items()):
        coords = run.coordinates.get(rank)
        stage = None if coords is None else coords.pp
        for report in reports:
            p = _prediction(predictions, report.iteration, rank, stage)
            measured = report.get("max_allocated")
            row = {"rank": rank, "stage": stage, "iteration": report.iteration, "measured_max_allocated_bytes": measured,
                   "phase": None, "predicted_max_allocated_bytes": None, "gap_bytes": None,
                   "reserved_minus_allocated_bytes": _minus(report.get("max_reserved"), measured),
                   "private_pool_bytes": (oom.get(rank) or {}).get("private_pool_bytes"),
                   "process_minus_reserved_bytes": _process(oom.get(rank)), "unmodelled": None,
                   "rounding_bytes": (report.rounding or {}).get("max_allocated")}
            if p is not None:
                row.update(phase=p.phase, predicted_max_allocated_bytes=p.max_allocated_bytes,
                           gap_bytes=_minus(measured, p.max_allocated_bytes), unmodelled=p.unmodelled,
                           stage=p.stage if stage is None else stage)
            rows.append(row)
    return rows


def _minus(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return None if a is None or b is None else a - b


def _process(numbers: Optional[dict]) -> Optional[int]:
    """The process's own memory in use minus what its allocator reserved, from its OOM message."""
    if not numbers or numbers.get("this_process_bytes") is None or numbers.get("reserved_bytes") is None:
        return None
    return numbers["this_process_bytes"] - numbers["reserved_bytes"]


def lines(rows: list[dict]) -> list[str]:
    """The comparison as a table, in GiB (2^30 bytes)."""
    if not rows:
        return ["estimate beside the log: no memory report line to compare"]
    from megatron_bridge_ext.table import text_table

    gib = sizes.gib_figure  # the figures of GiB columns, as every mbx command prints them
    table = []
    for r in rows:
        table.append([str(r["rank"]), "-" if r["stage"] is None else str(r["stage"]), str(r["iteration"]),
                      r["phase"] or "not estimated", gib(r["measured_max_allocated_bytes"]),
                      gib(r["predicted_max_allocated_bytes"]), gib(r["gap_bytes"], signed=True),
                      gib(r["reserved_minus_allocated_bytes"]), gib(r["private_pool_bytes"]),
                      gib(r["process_minus_reserved_bytes"])])
    out = ["estimate beside the log, max allocated in GiB (2^30 bytes), each report against the phase it was "
           "taken in:",
           text_table(["rank", "stage", "after iteration", "phase", "measured", "estimate", "gap",
                       "reserved - allocated", "private pools", "process - reserved"], table, right_aligned=True)]
    unmodelled = sorted({r["unmodelled"] for r in rows if r["unmodelled"]})
    out += [f"not in the estimate: {u}" for u in unmodelled]
    return out
