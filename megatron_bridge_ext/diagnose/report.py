"""Every input of one `mbx diagnose` call -> one run diagnosis: a headline per failing rank, the per-rank table.

Works on records only (:mod:`.logs`, :mod:`.classifier`, the snapshot reader): it resolves the layout
(the log's lines, else the command line's sizes, else the highest rank seen), places every rank in it
(:mod:`.layout`), classifies each rank's OOM (:mod:`.events`) and lays out the last memory report of
each rank. Figures are in GiB (2^30 bytes); Bridge prints GB (10^9 bytes), Megatron-LM MB (2^20).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_bridge_ext import sizes
from megatron_bridge_ext.diagnose import events
from megatron_bridge_ext.diagnose.layout import DEFAULT_ORDER, TP_PP_DP_ORDER, Layout, LayoutError
from megatron_bridge_ext.evidence import step_text

UNIT = "GiB (2^30 bytes; Bridge's log prints GB = 10^9 bytes)"
SIZES = ("world", "tp", "pp", "cp", "ep", "etp", "dp")


@dataclass
class Failure:
    """One failing rank: its class, the numbers, the next step, where it was read."""

    rank: Optional[int]
    verdict: events.Verdict
    where: str
    coordinates: Optional[str] = None

    def headline(self) -> str:
        who = "rank ?" if self.rank is None else f"rank {self.rank}"
        if self.coordinates:
            who += f" = {self.coordinates}"
        step = self.verdict.next_step
        numbered = f"step {step['step']} of 5, {step['name']}" if step.get("step") else step["name"]
        return f"{who}: {self.verdict.kind}: {self.verdict.summary}; next ({numbered}): {step_text(step)}"

    def to_dict(self) -> dict:
        return {"rank": self.rank, "coordinates": self.coordinates, "where": self.where, **self.verdict.to_dict()}


@dataclass
class RunDiagnosis:
    layout: Optional[Layout]
    failures: list
    reports: dict  # rank -> [MemoryReport, ...] in iteration order
    notes: list = field(default_factory=list)
    theoretical: Optional[object] = None
    coordinates: dict = field(default_factory=dict)  # rank -> Coordinates
    snapshots: list = field(default_factory=list)  # the snapshot reader's summaries
    facts: list = field(default_factory=list, repr=False)  # the logs' records, for placing the run again
    layout_notes: list = field(default_factory=list)  # what placing the ranks assumed
    comparison: list = field(default_factory=list)  # rows of :func:`.compare.compare`, with an estimate
    graph_pools: list = field(default_factory=list)  # rows of :func:`.graph_pools.compare`, with an estimate

    # ---- derived views -------------------------------------------------------------------------------
    def last_reports(self) -> dict:
        return {rank: reports[-1] for rank, reports in sorted(self.reports.items())}

    def peak(self) -> Optional[tuple[int, object]]:
        last = [(r.get("max_allocated"), rank, r) for rank, r in self.last_reports().items()
                if r.get("max_allocated") is not None]
        if not last:
            return None
        _, rank, report = max(last, key=lambda t: (t[0], -t[1]))
        return rank, report

    def silent_ranks(self) -> Optional[list[int]]:
        """Ranks that report memory in Bridge and Megatron-LM (data-parallel rank 0) but printed no report."""
        if self.layout is None or not self.reports:
            return None
        expected = [r for r, c in self.coordinates.items() if c.dp == 0]
        return [r for r in expected if r not in self.reports]

    def stage_spread(self) -> list[dict]:
        """Per pipeline stage: the reporting ranks' max allocated, lowest and highest (DP, CP, TP and EP replicas)."""
        by_stage: dict[int, list] = {}
        for rank, report in self.last_reports().items():
            coords = self.coordinates.get(rank)
            if coords is not None and report.get("max_allocated") is not None:
                by_stage.setdefault(coords.pp, []).append((report.get("max_allocated"), rank))
        out = []
        for stage, values in sorted(by_stage.items()):
            low, high = min(values), max(values)
            out.append({"stage": stage, "ranks": len(values), "low_rank": low[1], "low_bytes": low[0],
                        "high_rank": high[1], "high_bytes": high[0], "spread_bytes": high[0] - low[0]})
        return out

    def rises(self) -> list[dict]:
        """Per rank, what max allocated and allocated gained from its first report to its second."""
        out = []
        for rank, reports in sorted(self.reports.items()):
            if len(reports) < 2:
                continue
            first, second = reports[0], reports[1]
            row = {"rank": rank, "from_iteration": first.iteration, "to_iteration": second.iteration}
            for name in ("max_allocated", "allocated"):
                a, b = first.get(name), second.get(name)
                row[f"{name}_rise_bytes"] = None if a is None or b is None else b - a
            out.append(row)
        return out

    # ---- output --------------------------------------------------------------------------------------
    def format(self) -> str:
        if self.snapshots and not self.failures and not self.reports:  # snapshots alone: their own lines
            return "\n".join(line for summary in self.snapshots for line in summary.lines())
        lines = [f"{f.headline()} [{f.where}]" for f in self.failures] or ["no out-of-memory error in the inputs"]
        if self.layout is not None:
            lines.append(f"layout: {self.layout.text()}; from {_sources(self.layout)}")
        lines += self._table()
        if self.comparison:
            from megatron_bridge_ext.diagnose.compare import lines as comparison_lines

            lines += comparison_lines(self.comparison)
        if self.graph_pools:
            from megatron_bridge_ext.diagnose.graph_pools import lines as pool_lines

            lines += pool_lines(self.graph_pools)
        lines += [f"note: {n}" for n in self.notes + self.layout_notes]
        for summary in self.snapshots:
            lines.append("")
            lines += summary.lines()
        return "\n".join(lines)

    def _table(self) -> list[str]:
        gib = sizes.gib_figure  # the figures of GiB columns and sentences, as every mbx command prints them
        last = self.last_reports()
        if not last:
            return ["memory reports: none in the inputs (Bridge prints them on data-parallel rank 0 after the "
                    "first logging steps: logger.log_interval)"]
        from megatron_bridge_ext.table import text_table

        rows = []
        for rank, r in last.items():
            coords = self.coordinates.get(rank)
            rows.append([str(rank), "-" if coords is None else str(coords.pp), str(r.iteration), gib(r.get("allocated")),
                         gib(r.get("max_allocated")), gib(r.get("reserved")), gib(r.get("max_reserved")),
                         "-" if r.retries is None else str(r.retries)])
        lines = [f"last memory report of each rank, in {UNIT}:",
                 text_table(["rank", "stage", "after iteration", "allocated", "max allocated", "reserved",
                             "max reserved", "retries"], rows, right_aligned=True)]
        peak = self.peak()
        if peak:
            rank, report = peak
            coords = self.coordinates.get(rank)
            where = f" (PP stage {coords.pp})" if coords else ""
            lines.append(f"peak: rank {rank}{where}, {gib(report.get('max_allocated'))} GiB max allocated after "
                         f"iteration {report.iteration}")
        silent = self.silent_ranks()
        if silent is None:
            lines.append("ranks that printed no memory report: unknown without the layout (give --tp/--pp/--cp/--dp)")
        elif silent:
            lines.append(f"ranks that print a memory report (data-parallel rank 0) but printed none: "
                         f"{_ranks(silent)}")
        else:
            lines.append("every rank that prints a memory report (data-parallel rank 0) printed one")
        for s in self.stage_spread():
            if s["ranks"] > 1:
                lines.append(f"stage {s['stage']}: max allocated from {gib(s['low_bytes'])} GiB (rank {s['low_rank']}) "
                             f"to {gib(s['high_bytes'])} GiB (rank {s['high_rank']}) across its {s['ranks']} reporting "
                             f"ranks: spread {gib(s['spread_bytes'])} GiB")
        rises = self.rises()
        if rises:
            steps = sorted({(r["from_iteration"], r["to_iteration"]) for r in rises})
            lines.append("max allocated rose from the report after iteration " + " / ".join(f"{a} to {b}" for a, b in steps)
                         + ": " + ", ".join(f"rank {r['rank']} +{gib(r['max_allocated_rise_bytes'])}" for r in rises[:16])
                         + (f" and {len(rises) - 16} more" if len(rises) > 16 else "")
                         + " GiB (the report after iteration 2 is the first taken when the optimizer's moments and "
                         "a step's activations were alive together)")
        if self.theoretical is not None:
            t = self.theoretical
            lines.append(f"Bridge's theoretical estimate (rank 0): weight and optimizer {gib(t.weight_and_optimizer)} GiB"
                         + (f", activation {gib(t.activation)} GiB, total {gib(t.total)} GiB" if t.total else ""))
        return lines

    def to_dict(self) -> dict:
        return {
            "unit": "bytes",
            "failures": [f.to_dict() for f in self.failures],
            "layout": None if self.layout is None else self.layout.to_dict(),
            "coordinates": {str(r): c.to_dict() for r, c in sorted(self.coordinates.items())},
            "reports": {str(r): [x.to_dict() for x in rs] for r, rs in sorted(self.reports.items())},
            "last_reports": {str(r): x.to_dict() for r, x in self.last_reports().items()},
            "peak": None if self.peak() is None else {"rank": self.peak()[0],
                                                      "max_allocated_bytes": self.peak()[1].get("max_allocated")},
            "silent_ranks": self.silent_ranks(),
            "stage_spread": self.stage_spread(),
            "rises": self.rises(),
            "theoretical": None if self.theoretical is None else self.theoretical.to_dict(),
            "notes": list(self.notes + self.layout_notes),
            "estimate_beside_log": list(self.comparison),
            "graph_pools_beside_estimate": list(self.graph_pools),
            "snapshots": [s.to_dict() for s in self.snapshots],
        }


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:32])) + (f" and {len(ranks) - 32} more" if len(ranks) > 32 else "")


def _sources(layout: Layout) -> str:
    return ", ".join(f"{k} {v}" for k, v in layout.sources.items()) or "defaults"


def resolve_layout(stated: dict, facts: list, max_rank: Optional[int],
                   labels: Optional[dict] = None) -> tuple[Optional[Layout], list[str]]:
    """The layout from the logs' lines and the command line's sizes (they must agree), the world from the log,
    from TP x PP x CP x DP, else from the highest rank seen. LayoutError on a contradiction."""
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    order = DEFAULT_ORDER
    for f in facts:
        for size, (value, where) in f.layout.items():
            if size == "order":
                order = TP_PP_DP_ORDER
                continue
            if size in values and values[size] != value:
                raise LayoutError(f"{where}: {size} {value} contradicts {sources[size]} ({values[size]}): the inputs "
                                  "come from different runs. Fix: diagnose one run's logs at a time")
            values[size], sources[size] = value, where
    for size, value in stated.items():
        if value is None:
            continue
        label = (labels or {}).get(size, f"--{size}")
        said = f"{label} {value}" if label == f"--{size}" else f"{label}'s {size} {value}"
        if size in values and values[size] != value:
            raise LayoutError(f"{said} contradicts the log ({sources[size]} says {values[size]}). Fix: "
                              "give the value the run used")
        values[size], sources[size] = value, label
    notes = []
    if "world" not in values:
        model = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
        if "dp" in values:
            values["world"], sources["world"] = model * values["dp"], "TP x PP x CP x DP"
        elif max_rank is not None and any(k in values for k in ("tp", "pp", "cp", "ep")):
            world = max_rank + 1
            world += (-world) % model
            values["world"], sources["world"] = world, "the highest rank in the inputs"
            notes.append(f"world size {world} taken from the highest rank in the inputs; give --dp for the real one")
        else:
            return None, ["no layout in the inputs: give --tp/--pp/--cp/--ep/--dp for the ranks' coordinates"]
    dp = values.pop("dp", None)
    layout = Layout(values.pop("world"), **{k: v for k, v in values.items() if k in ("tp", "pp", "cp", "ep", "etp")},
                    order=order, sources=sources)
    if dp is not None and dp != layout.dp:
        raise LayoutError(f"DP {dp} ({sources['dp']}) contradicts world {layout.world} / (TP x PP x CP) = {layout.dp}. "
                          "Fix: give the sizes the run used")
    if max_rank is not None and max_rank >= layout.world:
        raise LayoutError(f"rank {max_rank} appears in the inputs, beyond the world of {layout.world} ranks "
                          f"({_sources(layout)}). Fix: give the world size the run used (--dp)")
    return layout, notes
