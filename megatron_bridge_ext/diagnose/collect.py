"""`mbx diagnose`'s inputs -> one :class:`~.report.RunDiagnosis`: each input to its reader, the records joined.

A single JSON input (``torch.cuda.memory_stats()`` or an OOM report) keeps its own output
(:class:`~.classifier.Diagnosis`); any other mix of logs, JSON and snapshots gives the run view.
"""

from __future__ import annotations

import json
from typing import Optional

from megatron_bridge_ext.diagnose import events, logs
from megatron_bridge_ext.diagnose.classifier import NO_OOM, Diagnosis, diagnose_data
from megatron_bridge_ext.diagnose.inputs import EXPECTED, JSON, LOG, PICKLE, InputError, expand, open_source
from megatron_bridge_ext.diagnose.layout import LayoutError
from megatron_bridge_ext.diagnose.report import Failure, RunDiagnosis, resolve_layout

NOTHING = ("no memory report line and no out-of-memory error; expected a training log of Megatron Bridge or "
           "Megatron-LM (its '[Rank N] (after K iterations) memory' lines or PyTorch's 'CUDA out of memory' message)")


def diagnose_inputs(paths: list[str], *, sizes: Optional[dict] = None, total_memory: Optional[int] = None,
                    expandable: Optional[bool] = None):
    """Read every input; InputError or LayoutError (one line each) for anything that cannot be read or placed."""
    facts, json_items, snapshots, skipped = [], [], [], []
    for path, explicit in expand(paths):
        try:
            source = open_source(path, explicit)
        except InputError as error:
            if explicit:
                raise
            skipped.append((path, str(error).split(": ", 1)[1].split(";")[0]))
            continue
        try:
            if source.kind == LOG:
                found = logs.read_log(source.text_lines(), source.name)
                if found.empty and explicit:
                    raise InputError(f"{source.name}: {NOTHING}")
                facts.append(found)
            elif source.kind == JSON:
                data = _json(source)
                if not explicit and not _is_stats_or_report(data):
                    skipped.append((path, "JSON that is neither torch.cuda.memory_stats() nor an OOM report"))
                    continue
                json_items.append((source.name, data))
            elif source.kind == PICKLE:
                snapshots.append(_snapshot(source))
        except (EOFError, OSError) as error:  # a truncated gzip stream, a read error
            raise InputError(f"{source.name}: cannot be read to its end ({error}); {EXPECTED}") from None
        finally:
            if source.stream is not None and source.name != "<stdin>":
                source.stream.close()
    if len(json_items) == 1 and not facts and not snapshots and not skipped:
        name, data = json_items[0]
        return _stats_diagnosis(name, data, total_memory, expandable)
    if not (facts or json_items or snapshots) or all(f.empty for f in facts) and not (json_items or snapshots):
        raise InputError(f"{', '.join(paths)}: {NOTHING}" + (f" ({_skipped_note(skipped)})" if skipped else ""))
    run = _run(facts, json_items, snapshots, sizes or {}, total_memory, expandable)
    if skipped:
        run.notes.append(_skipped_note(skipped))
    return run


def _is_stats_or_report(data: dict) -> bool:
    """A ``torch.cuda.memory_stats()`` dictionary or an OOM report of :class:`~.handler.OOMHandler` (its ``stats``)."""
    from megatron_bridge_ext.diagnose.classifier import ALLOCATED, RESERVED

    return (ALLOCATED in data and RESERVED in data) or isinstance(data.get("stats"), dict)


def _skipped_note(skipped: list) -> str:
    """The files of a directory that are no artifact of a run's memory, counted by reason, a few named."""
    by_reason: dict[str, list[str]] = {}
    for path, reason in skipped:
        by_reason.setdefault(reason, []).append(path)
    parts = [f"{len(names)} {reason} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
             for reason, names in by_reason.items()]
    return f"skipped {len(skipped)} file(s) found in the directories that are not a log, memory stats, an OOM " \
           "report or a snapshot: " + "; ".join(parts)


def _json(source) -> dict:
    try:
        data = json.load(source.text_lines())
    except json.JSONDecodeError as error:
        raise InputError(f"{source.name}: not JSON ({error}); {EXPECTED}") from None
    if not isinstance(data, dict):
        raise InputError(f"{source.name}: expected a JSON object (memory_stats() or an OOM report), got "
                         f"{type(data).__name__}")
    return data


def _snapshot(source):
    from megatron_bridge_ext.diagnose.snapshot import read_snapshot

    try:
        return read_snapshot(source.stream, source.name)
    except ValueError as error:  # the reader's one line already names the file
        raise InputError(str(error)) from None


def _stats_diagnosis(name: str, data: dict, total_memory, expandable) -> Diagnosis:
    try:
        return diagnose_data(data, total_memory=total_memory, expandable_segments=expandable)
    except ValueError as error:
        raise InputError(f"{name}: {error}") from None


def _run(facts, json_items, snapshots, sizes, total_memory, expandable) -> RunDiagnosis:
    reports: dict[int, list] = {}
    for f in facts:
        for located in f.reports:
            reports.setdefault(located.rank, []).append(located.record)
    for rank in reports:
        reports[rank] = _unique_iterations(reports[rank])
    failures, notes = _failures(facts, expandable), []  # notes: the readers'; place() adds the layout's
    for name, data in json_items:
        diagnosis = _stats_diagnosis(name, data, total_memory, expandable)
        if diagnosis.kind == NO_OOM:
            notes.append(f"{name}: {diagnosis.headline}")
            continue
        rank = data.get("rank") if isinstance(data.get("rank"), int) else logs.rank_from_name(name)
        failures.append(Failure(rank, events.Verdict(diagnosis.kind, diagnosis.headline.split(": ", 1)[1],
                                                     dict(diagnosis.next_step), diagnosis.metrics,
                                                     tuple(diagnosis.notes)), name))
    theoretical = next((f.theoretical for f in facts if f.theoretical is not None), None)
    return place(RunDiagnosis(None, failures, reports, notes, theoretical, {}, snapshots, facts=facts), sizes)


def place(run: RunDiagnosis, sizes: dict, labels: Optional[dict] = None) -> RunDiagnosis:
    """The run's layout from its logs and ``sizes`` (the command line's, or a config's), every rank placed.
    LayoutError when they contradict each other or a rank lies outside the world."""
    facts = run.facts
    ranks = set(run.reports) | {f.rank for f in run.failures if f.rank is not None}
    ranks |= {s.rank for s in run.snapshots if getattr(s, "rank", None) is not None}
    layout, notes = resolve_layout(sizes, facts, max(ranks) if ranks else None, labels)
    if any("local" in f.prefix_kinds for f in facts):
        notes.append("[<role>N]: prefixes (torchrun --tee) give the local rank: read as the global rank, as on one node")
    if any(logs.torchrun_rank(f.name) and f.file_rank is not None and not f.prefix_kinds for f in facts):
        notes.append("torchrun --log-dir folders (attempt_<n>/<local rank>/) give the local rank: read as the global "
                     "rank, as on one node")
    run.layout, run.layout_notes = layout, notes
    run.coordinates = {r: layout.coordinates(r) for r in range(layout.world)} if layout is not None else {}
    _check_reporters(run)
    for failure in run.failures:
        if failure.rank is not None and layout is not None:
            failure.coordinates = run.coordinates[failure.rank].text()
    return run


def _check_reporters(run: RunDiagnosis) -> None:
    """LayoutError when ranks printed memory reports that the layout puts on a data-parallel rank other than 0:
    Bridge prints them on data-parallel rank 0 only (training/utils/train_utils.py L1234,
    ``torch.distributed.get_rank(group=pg_collection.dp) == 0``), as Megatron-LM does, so such a layout is not the
    run's."""
    if run.layout is None:
        return
    stray = sorted(r for r in run.reports if r in run.coordinates and run.coordinates[r].dp != 0)
    if stray:
        places = ", ".join(f"rank {r} at DP {run.coordinates[r].dp}" for r in stray[:4]) + (", ..." if len(stray) > 4
                                                                                             else "")
        raise LayoutError(f"ranks {', '.join(map(str, stray[:8]))} printed memory reports, which Bridge prints on "
                          f"data-parallel rank 0 only, but {run.layout.text()} puts them elsewhere ({places}): the "
                          "layout contradicts the log. Fix: give the sizes the run used (--tp/--pp/--cp/--dp)")


def _unique_iterations(reports: list) -> list:
    """One report per iteration (a log given twice, or merged with its per-rank copy, repeats lines)."""
    seen, out = set(), []
    for report in sorted(reports, key=lambda r: r.iteration):
        if report.iteration not in seen:
            seen.add(report.iteration)
            out.append(report)
    return out


def _failures(facts, expandable) -> list[Failure]:
    """The first OOM of each rank (a traceback is often printed twice); each distinct one of unknown ranks."""
    out, seen = [], set()
    for f in facts:
        for located in f.allocator_ooms + f.external_ooms:
            key = located.rank if located.rank is not None else ("?", repr(located.record))
            if key in seen:
                continue
            seen.add(key)
            record = located.record
            verdict = (events.classify_message(record, expandable=expandable) if hasattr(record, "wording")
                       else events.classify_external(record))
            out.append(Failure(located.rank, verdict, f"{f.name}:{located.line}"))
    return sorted(out, key=lambda x: (x.rank is None, x.rank if x.rank is not None else 0))


__all__ = ["InputError", "LayoutError", "diagnose_inputs"]
