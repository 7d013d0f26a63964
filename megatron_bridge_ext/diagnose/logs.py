"""A training log, one line at a time, -> the facts `mbx diagnose` needs (never the whole file in memory).

Launchers prefix each rank's lines, and a merged log interleaves them:

* ``[rank3]:`` (torch.distributed's prefix on a rank's traceback: the global rank);
* ``[default3]:`` (torchrun ``--tee``: the role name and the *local* rank, the global rank on one node);
* ``3: `` (Slurm ``srun --label``: the task id, the global rank);
* ``[1,3]<stderr>:`` (Open MPI ``--tag-output``: job and global rank).

Prefixes may be nested (a launcher around a prefixed traceback); each is stripped, the innermost
rank kept. A line without a prefix belongs to the file's rank when the file name says one
(``rank3.log``, ``log_rank_3.txt``), else to no known rank. Lines are routed to the small parsers
of :mod:`.oom_text` and :mod:`.memory_lines` after a cheap substring test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

from megatron_bridge_ext.diagnose import memory_lines, oom_text

_PREFIXES = (
    ("global", re.compile(r"^\[rank(\d+)\]:\s?")),
    ("local", re.compile(r"^\[(?!rank\d)[A-Za-z_][\w-]*?(\d+)\]:\s?")),
    ("global", re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>:\s?")),
    ("global", re.compile(r"^\s*(\d+): ")),
)
_TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\s+")
"""A collector's timestamp before the line (``kubectl logs --timestamps``: RFC 3339 with nanoseconds and ``Z``)."""
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
"""Terminal colour and cursor codes (ESC [ ... letter) that a logger writes when it believes it prints to a terminal."""
_NAME_RANK = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_CUES = ("memory (", "out of memory", "Cuda failure", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation",
         "Theoretical memory", "parallel", "world size", "HyperCommGrid", "use_tp_pp_dp_mapping")


@dataclass
class Located:
    """A record with where it was found."""

    rank: Optional[int]
    line: int
    record: object


@dataclass
class LogFacts:
    """What one log says: memory reports, OOMs, the layout lines, the prefixes it used."""

    name: str
    file_rank: Optional[int] = None
    reports: list = field(default_factory=list)
    allocator_ooms: list = field(default_factory=list)
    external_ooms: list = field(default_factory=list)
    theoretical: Optional[memory_lines.TheoreticalMemory] = None
    layout: dict = field(default_factory=dict)
    prefix_kinds: set = field(default_factory=set)
    ranks_seen: set = field(default_factory=set)
    lines: int = 0

    @property
    def empty(self) -> bool:
        return not (self.reports or self.allocator_ooms or self.external_ooms)


_TORCHRUN_DIR = re.compile(r"(?:^|/)attempt_\d+/(\d+)/(?:stdout|stderr|error)\.(?:log|json)$")
"""torchrun ``--log-dir``'s layout: ``<log dir>/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log`` and
``error.json`` (torch 2.14.1 torch/distributed/elastic/multiprocessing/api.py L290-292, ``DefaultLogsSpecs.reify``:
``attempt_{restart_count}`` L313-314 and one folder per local rank)."""


def rank_from_name(name: str) -> Optional[int]:
    """The rank a per-rank log's file name states (``rank3.log``), or torchrun's log folder's local rank, or None."""
    found = _NAME_RANK.findall(name.rsplit("/", 1)[-1])
    if found:
        return int(found[-1])
    folder = _TORCHRUN_DIR.search(name.replace("\\", "/"))
    return int(folder.group(1)) if folder else None


def torchrun_rank(name: str) -> bool:
    """Whether ``name``'s rank comes from torchrun's log folder (a local rank)."""
    return not _NAME_RANK.findall(name.rsplit("/", 1)[-1]) and bool(_TORCHRUN_DIR.search(name.replace("\\", "/")))


def strip_prefixes(line: str) -> tuple[str, Optional[int], Optional[str]]:
    """The line without colour codes, NUL bytes (logrotate's copytruncate leaves the truncated head as NULs), a
    collector's timestamp and launcher prefixes; the innermost prefix's rank and its kind (global or local)."""
    line = _ANSI.sub("", line.replace("\x00", "")) if "\x1b" in line or "\x00" in line else line
    rank = kind = None
    while True:
        stamp = _TIMESTAMP.match(line)
        if stamp:
            line = line[stamp.end():]
        for prefix_kind, pattern in _PREFIXES:
            match = pattern.match(line)
            if match:
                rank, kind = int(match.group(1)), prefix_kind
                line = line[match.end():]
                break
        else:
            return line, rank, kind


def read_log(lines: Iterable[str], name: str) -> LogFacts:
    """Stream ``lines`` of one log into :class:`LogFacts`. ValueError names the file and line of a figure that
    cannot be read."""
    facts = LogFacts(name, file_rank=rank_from_name(name))
    for number, raw in enumerate(lines, 1):
        facts.lines = number
        if not any(cue in raw for cue in _CUES):
            continue
        text, rank, kind = strip_prefixes(raw.rstrip("\n"))
        if kind:
            facts.prefix_kinds.add(kind)
        rank = facts.file_rank if rank is None else rank
        try:
            _route(facts, text, rank, number)
        except (ValueError, OverflowError) as error:
            raise ValueError(f"{name}:{number}: {error}: expected a number in this memory line") from None
    return facts


def _route(facts: LogFacts, text: str, rank: Optional[int], number: int) -> None:
    if "out of memory" in text or "Cuda failure" in text or "ALLOC_FAILED" in text or "MemoryAllocation" in text:
        event = oom_text.parse_allocator(text)
        if event is not None:
            facts.allocator_ooms.append(Located(rank, number, event))
            _seen(facts, rank)
            return
        external = oom_text.parse_external(text)
        if external is not None:
            facts.external_ooms.append(Located(rank, number, external))
            _seen(facts, rank)
            return
    if "memory (" in text:
        report = memory_lines.parse_report(text)
        if report is not None:
            facts.reports.append(Located(report.rank, number, report))
            _seen(facts, report.rank)
            return
    if "Theoretical memory" in text:
        facts.theoretical = memory_lines.parse_theoretical(text) or facts.theoretical
        return
    for size, value in memory_lines.parse_layout(text):
        facts.layout.setdefault(size, (value, f"{facts.name}:{number}"))


def _seen(facts: LogFacts, rank: Optional[int]) -> None:
    if rank is not None:
        facts.ranks_seen.add(rank)
