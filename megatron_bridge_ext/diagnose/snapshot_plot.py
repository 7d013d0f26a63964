"""The segment map of a memory snapshot at the OOM: one bar per segment, its blocks by state, the request beside
the largest free block, so a reader sees why no block held the request.

matplotlib is imported only when a picture is drawn (``mbx diagnose`` without ``--plot`` never needs it),
and through its object interface (``Figure`` + the Agg canvas), so no global pyplot state or backend is
changed in the caller's process.
"""

from __future__ import annotations

from typing import Union

from megatron_bridge_ext.diagnose.classifier import fmt_bytes
from megatron_bridge_ext.diagnose.snapshot import (
    ALLOCATED, AWAITING_FREE, DeviceSummary, SnapshotSummary, summarize,
)
from megatron_bridge_ext.sizes import GIB, MIB

MAX_SEGMENTS = 24
"""Bars drawn at most, the largest segments first (the title says how many were left out)."""
COLORS = {ALLOCATED: "#3b6fb6", AWAITING_FREE: "#e8a33d", "inactive": "#e6e6e6"}
LABELS = {ALLOCATED: "allocated", AWAITING_FREE: "active, awaiting free", "inactive": "free (inactive)"}
DPI = 110
ROW_INCHES = 0.32
"""Height per bar: enough for one 8-point tick label with space around it."""


def plot_snapshot(summary_or_snapshot: Union[SnapshotSummary, dict, list], path: str) -> None:
    """Draw the segment map of the device that ran out of memory (else the first device) to ``path`` (PNG)."""
    figure = build_figure(summary_or_snapshot)
    figure.savefig(path, dpi=DPI)


def build_figure(summary_or_snapshot: Union[SnapshotSummary, dict, list]):
    """The matplotlib Figure :func:`plot_snapshot` saves (a snapshot dictionary is summarised first)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = summary_or_snapshot if isinstance(summary_or_snapshot, SnapshotSummary) else \
        summarize(summary_or_snapshot, "snapshot")
    device = _device_to_draw(summary)
    segments = sorted(device.segments, key=lambda s: -s.total_size)[:MAX_SEGMENTS]
    rows = len(segments) + (1 if device.oom else 0)
    figure = Figure(figsize=(10, 2.4 + ROW_INCHES * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    scale, unit = (GIB, "GiB") if max(s.total_size for s in segments) >= GIB else (MIB, "MiB")
    labels = [_draw_segment(axes, row, segment, scale, device) for row, segment in enumerate(segments)]
    if device.oom:
        labels.append(_draw_request(axes, len(segments), device, scale))
    axes.set_yticks(range(rows), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(f"offset within the segment ({unit})")
    axes.set_ylabel("segment (largest first)")
    axes.xaxis.get_major_locator().set_params(nbins=8)
    figure.legend(handles=_legend(device), loc="outside lower center", ncols=3, fontsize=8)
    figure.suptitle(_title(summary, device, len(segments)), fontsize=10)
    return figure


def _device_to_draw(summary: SnapshotSummary) -> DeviceSummary:
    drawable = [d for d in summary.devices if d.segments]
    if not drawable:
        raise ValueError(f"{summary.name}: nothing to draw: the snapshot holds no segments")
    return next((d for d in drawable if d.oom), drawable[0])


def _draw_segment(axes, row: int, segment, scale: int, device: DeviceSummary) -> str:
    """The segment's blocks left to right as they lie in memory; the largest free block outlined in red."""
    offset, marked = 0, False
    for block in segment.blocks:
        largest = block.state == "inactive" and block.size == device.largest_free_block_bytes and not marked
        marked = marked or largest
        axes.barh(row, block.size / scale, left=offset / scale, height=0.7, color=COLORS[block.state],
                  edgecolor="#c0392b" if largest else "white", linewidth=2 if largest else 0.5)
        offset += block.size
    pool = " private pool" if segment.private else ""
    return f"#{row + 1}: {fmt_bytes(segment.total_size)}{pool}"


def _draw_request(axes, row: int, device: DeviceSummary, scale: float) -> str:
    """The failed request as a bar of its own, with the largest free block's size as a dashed line."""
    axes.barh(row, device.oom.request_bytes / scale, height=0.7, color="#c0392b")
    axes.axvline(device.largest_free_block_bytes / scale, color="#c0392b", linestyle="--", linewidth=1)
    return "oom request"


def _legend(device: DeviceSummary) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COLORS[state], edgecolor="#999999", label=label) for state, label in LABELS.items()]
    if device.oom:
        handles.append(Patch(facecolor="#c0392b", label=f"oom request, {fmt_bytes(device.oom.request_bytes)}"))
        handles.append(Line2D([], [], color="#c0392b", linestyle="--",
                              label=f"largest free block (red outline), {fmt_bytes(device.largest_free_block_bytes)}"))
    return handles


def _title(summary: SnapshotSummary, device: DeviceSummary, drawn: int) -> str:
    rank = "rank unknown" if summary.rank is None else f"rank {summary.rank}"
    verdict = device.verdict
    kind = "fragmentation shown" if verdict.kind == "fragmentation" else \
        verdict.kind + (f", fragmentation {verdict.fragmentation}" if device.oom else "")
    shown = "" if drawn == device.segment_count else f"; the {drawn} largest of {device.segment_count} segments"
    return f"{summary.name}: {rank}, device {device.device}: {kind}\nsegment map at the snapshot{shown}"


