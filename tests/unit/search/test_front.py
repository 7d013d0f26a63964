"""The front is non-dominated and holds every point no other beats; the answer is the fastest fitting point."""

import random
from dataclasses import dataclass

from megatron_bridge_ext.search.front import pareto
from megatron_bridge_ext.search.walk import Search


@dataclass
class P:
    peak_bytes: int
    step_time_s: float
    fits: bool = True
    candidate: object = None


def beats(a, b):
    return a.peak_bytes <= b.peak_bytes and a.step_time_s <= b.step_time_s and (a.peak_bytes, a.step_time_s) != (
        b.peak_bytes, b.step_time_s)


def test_front_is_exactly_the_non_dominated_points():
    rng = random.Random(0)
    points = [P(rng.randrange(100), rng.randrange(100) / 10) for _ in range(300)]
    front = pareto(points)
    assert not any(beats(q, p) for p in front for q in points)
    assert {id(p) for p in points if not any(beats(q, p) for q in points)} <= {id(p) for p in front} | {
        id(p) for p in points if any((q.peak_bytes, q.step_time_s) == (p.peak_bytes, p.step_time_s) and q is not p
                                     for q in points)}


def test_answer_is_fastest_fitting():
    s = Search(given=None, world=8, global_batch=8, seq=8, usable=50, usable_expandable=50)
    s.evaluated = [P(70, 1.0, False), P(40, 2.0), P(30, 3.0), P(60, 1.5, False)]
    assert s.answer is s.evaluated[1]
    assert not any(p.fits and p.step_time_s < s.answer.step_time_s for p in s.front)
