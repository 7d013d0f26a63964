"""Which candidate answers: the fastest that fits, with no lever that does not lower its peak.

One rule for ``mbx plan --search`` (every layout on N GPUs) and the plain ``mbx plan`` (the levers reachable from the
layout as given): candidates are estimated in :func:`walk_order`, :func:`fastest` picks among the estimated ones, and
:func:`drop_idle` takes back a lever whose removal leaves the largest phase's peak where it is (a lever that saves no
memory here costs time for nothing, or at best nothing). Pure functions of candidates and their figures: no estimate.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable, Optional

from megatron_bridge_ext.search.candidates import FULL, Candidate

LEVER_FIELDS = ("tp", "pp", "vpp", "cp", "ep", "etp", "sp", "micro_batch", "distributed_optimizer", "fsdp",
                "bf16_moments", "offload", "optimizer_offload")
"""The candidate fields that are one lever each (DP follows TP, PP and CP on the same GPUs; the optimizer offload's
overlap follows its fraction); recompute counts per module (:func:`_recompute_levers`)."""


def lever_count(given: Candidate, c: Candidate) -> int:
    """How many levers ``c`` moves away from ``given``: one per changed field, one per recompute module added or
    dropped (switching to or from full recompute is one)."""
    moved = [f for f in LEVER_FIELDS if getattr(given, f) != getattr(c, f)]
    if "etp" in moved and _etp_follows_tp(given) and _etp_follows_tp(c):
        moved.remove("etp")
    return len(moved) + _recompute_levers(given.recompute, c.recompute)


def _etp_follows_tp(c: Candidate) -> bool:
    """The expert TP equals TP: on a dense model (and where an MoE model sets it so) it moves with TP, no lever."""
    return c.etp == c.tp


def _recompute_levers(a, b) -> int:
    if a == b:
        return 0
    if a == FULL or b == FULL:
        return 1
    return len(set(a) ^ set(b))


def walk_order(candidates: Iterable[Candidate], predicted: dict, given: Candidate) -> list[Candidate]:
    """Fastest predicted first; at equal predicted time, fewer levers first (the config as given before all)."""
    return sorted(candidates, key=lambda c: (predicted[c], lever_count(given, c)))


def fastest(evaluated: list, given: Candidate):
    """The estimated candidate that fits with the least step time; at equal time the smaller peak, then fewer levers
    (``evaluated``: records with ``candidate``, ``fits``, ``step_time_s`` and ``peak_bytes``). None when none fits."""
    fitting = [e for e in evaluated if e.fits]
    return min(fitting, key=lambda e: (e.step_time_s, e.peak_bytes, lever_count(given, e.candidate)),
               default=None)


def reverts(given: Candidate, c: Candidate) -> list[Candidate]:
    """``c`` with one of its levers taken back to ``given``'s value each: a changed field (TP and PP with the DP that
    keeps the GPUs), or one recompute module (full recompute back to the recompute as given)."""
    out = []
    world = c.tp * c.pp * c.cp * c.dp
    for f in LEVER_FIELDS:
        if getattr(given, f) == getattr(c, f):
            continue
        back = replace(c, **{f: getattr(given, f)})
        if f == "etp" and _etp_follows_tp(given) and _etp_follows_tp(c):
            continue
        if f == "tp" and _etp_follows_tp(given) and _etp_follows_tp(c):
            back = replace(back, etp=given.etp)
        if f in ("tp", "pp", "cp"):
            grid = back.tp * back.pp * back.cp
            if world % grid:
                continue
            back = replace(back, dp=world // grid)
        if f == "tp" and back.tp == 1:
            back = replace(back, sp=False)
        if f == "optimizer_offload":
            back = replace(back, optimizer_overlap=given.optimizer_overlap)
        out.append(back)
    if c.recompute == FULL or given.recompute == FULL:
        if c.recompute != given.recompute:
            out.append(replace(c, recompute=given.recompute))
    else:
        out += [replace(c, recompute=tuple(m for m in c.recompute if m != module))
                for module in c.recompute if module not in given.recompute]
    return out


def drop_idle(answer, given: Candidate, evaluate: Callable[[Candidate], Optional[object]]):
    """``answer`` with every lever that does not lower its peak taken back, one at a time, while what is left fits:
    a revert (:func:`reverts`) that :func:`evaluate` finds fitting with a peak no larger replaces the answer. Returns
    the answer kept and what each of its levers saves, ``{description: bytes}`` (the revert's peak minus the
    answer's; a revert that cannot be estimated is left out)."""
    while True:
        saves = {}
        for back in reverts(given, answer.candidate):
            e = evaluate(back)
            if e is None:
                continue
            if e.fits and e.peak_bytes <= answer.peak_bytes:
                answer = e
                break
            saves[describe_revert(answer.candidate, back)] = e.peak_bytes - answer.peak_bytes
        else:
            return answer, saves


def describe_revert(c: Candidate, back: Candidate) -> str:
    """The lever ``back`` takes off ``c``, in a few words (``recompute mlp``, ``TP 2->4``)."""
    if c.recompute != back.recompute:
        if c.recompute == FULL:
            return "full recompute"
        return "recompute " + "+".join(m for m in c.recompute if m not in back.recompute)
    names = {"tp": "TP", "pp": "PP", "vpp": "VPP", "cp": "CP", "ep": "EP", "etp": "ETP", "sp": "SP",
             "micro_batch": "micro-batch", "distributed_optimizer": "distributed optimizer"}
    f = next(f for f in LEVER_FIELDS if getattr(c, f) != getattr(back, f))
    if f == "optimizer_offload":
        return f"optimizer offload {getattr(back, f) or 'off'}->{getattr(c, f) or 'off'}"
    return f"{names[f]} {_v(getattr(back, f))}->{_v(getattr(c, f))}"


def _v(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
