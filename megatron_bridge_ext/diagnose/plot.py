"""The picture of a run: per-rank max allocated and max reserved against the device, grouped by pipeline stage.

Drawn from a :class:`~.report.RunDiagnosis`'s last report of each rank (matplotlib, imported here
only). A snapshot alone is drawn by :mod:`.snapshot_plot`.
"""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext.sizes import GIB


class NothingToDraw(ValueError):
    """The inputs hold no figure the picture could show."""


def draw(result, path: str, *, total_memory: Optional[int] = None) -> None:
    from megatron_bridge_ext.diagnose.report import RunDiagnosis

    if not isinstance(result, RunDiagnosis):
        raise NothingToDraw("a memory_stats() dump holds one rank at one instant: give the training log for the "
                            "per-rank picture")
    last = result.last_reports()
    if not last:
        if result.snapshots:
            return _snapshot(result, path)
        raise NothingToDraw("no memory report line in the inputs, so no per-rank bars")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(last, key=lambda r: (_stage(result, r), r))
    labels = [f"{r}" for r in ranks]
    allocated = [(last[r].get("max_allocated") or 0) / GIB for r in ranks]
    reserved = [(last[r].get("max_reserved") or 0) / GIB for r in ranks]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(ranks) + 3), 5))
    xs = range(len(ranks))
    ax.bar([x - 0.2 for x in xs], reserved, width=0.4, label="max reserved", color="#9ecae1")
    ax.bar([x + 0.2 for x in xs], allocated, width=0.4, label="max allocated", color="#3182bd")
    total = total_memory or _total(result)
    if total:
        ax.axhline(total / GIB, color="#d62728", linestyle="--", label=f"device total {total / GIB:.1f} GiB")
    labelled = _stage_bands(ax, result, ranks)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=90 if len(ranks) > 24 else 0, fontsize=8 if len(ranks) > 24 else 10)
    ax.set_xlabel("global rank (grouped by pipeline stage)")
    ax.set_ylabel("memory per GPU (GiB)")
    iterations = sorted({last[r].iteration for r in ranks})
    ax.set_title(f"max allocated and max reserved per rank, last report (after iteration "
                 f"{', '.join(map(str, iterations))})" + (f"\n{result.layout.text()}" if result.layout else ""),
                 fontsize=10, pad=STAGE_LABEL_PAD if labelled else 6.0)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _stage(result, rank: int) -> int:
    coords = result.coordinates.get(rank)
    return -1 if coords is None else coords.pp


STAGE_LABEL_PAD = 16.0
"""Points between the axes and the title when stage labels sit on the axes' top edge: a label's 8-point line and
its padding, so that the title clears them (matplotlib's default pad, 6 points, put them across the title)."""


def _stage_bands(ax, result, ranks) -> bool:
    """A shaded band and a label per pipeline stage; whether it drew any label."""
    if not result.coordinates:
        return False
    start = 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or _stage(result, ranks[i]) != _stage(result, ranks[start]):
            stage = _stage(result, ranks[start])
            if stage % 2:
                ax.axvspan(start - 0.5, i - 0.5, color="#eeeeee", zorder=0)
            ax.text((start + i - 1) / 2, 1.0, f"stage {stage}", transform=ax.get_xaxis_transform(), ha="center",
                    va="bottom", fontsize=8)
            start = i
    return True


def _total(result) -> Optional[int]:
    for failure in result.failures:
        total = failure.verdict.numbers.get("total_bytes") or failure.verdict.numbers.get("total_memory")
        if total:
            return total
    return None


def _snapshot(result, path: str) -> None:
    from megatron_bridge_ext.diagnose.snapshot_plot import plot_snapshot

    plot_snapshot(result.snapshots[0], path)
