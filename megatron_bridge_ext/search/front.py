"""The Pareto front of peak memory against step time."""

from __future__ import annotations


def pareto(points: list) -> list:
    """The points no other point beats on both peak and step time (``peak_bytes``, ``step_time_s``), fastest first:
    each is smaller in peak than every faster one."""
    out, lowest = [], None
    for p in sorted(points, key=lambda p: (p.step_time_s, p.peak_bytes)):
        if lowest is None or p.peak_bytes < lowest:
            out.append(p)
            lowest = p.peak_bytes
    return out
