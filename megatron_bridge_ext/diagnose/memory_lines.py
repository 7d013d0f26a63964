"""Bridge's and Megatron-LM's memory report lines, and the layout lines of their logs, as records.

* Bridge (``megatron/bridge/training/utils/train_utils.py``, ``training_log`` and ``report_memory``,
  0.5.1-0.6.2): on every rank whose data-parallel rank is 0,
  ``"[Rank {r}] (after {i} iterations) memory (GB) | mem-allocated-gigabytes: {v} | ..."``, one field
  per ``MEMORY_KEYS`` entry: a ``torch.cuda.memory_stats()`` key renamed (``allocated_bytes.all.peak``
  -> ``mem-max-allocated-bytes``, printed as ``mem-max-allocated-gigabytes``), bytes / 10^9 rounded to
  5 significant digits; ``num_alloc_retries`` -> ``mem-alloc-retires`` and ``allocation.all.current`` ->
  ``mem-allocated-count`` are counts. It reports at each logging step until the step after the first
  (``iteration > loaded_iteration + 1``), so with ``log_interval=1`` after iterations 1 and 2: "Make sure
  the memory after the second iteration is reported to include optimizer state memory".
  Rank 0 also prints ``"Theoretical memory footprints: weight and optimizer={w:.2f} MB[, activation=
  {a:.2f} MB, total={t:.2f} MB]"`` (``theoretical_memory_utils.py``; MB = 1024 * 1024 bytes there).
* Megatron-LM (``megatron/training/utils.py`` / ``common_utils.py``, ``report_memory``):
  ``"[Rank {r}] (after {i} iterations) memory (MB) | allocated: {v} | max allocated: {v} | reserved: {v}
  | max reserved: {v}"``, bytes / (1024 * 1024) unrounded, also on data-parallel rank 0 only.
* Layout: Bridge's rank 0 prints ``"> initialized tensor model parallel with size {t}"``, ``"> initialized
  pipeline model parallel with size {p}"`` (``training/initialize.py``) and, in its configuration summary
  (``ConfigContainer.log_non_default_values``), ``"  tensor_model_parallel_size: 2  (Mcore default: 1)"``;
  Megatron-LM prints ``"using world size: {w}, data-parallel size: {d}, context-parallel size: {c}, ...
  tensor-model-parallel size: {t}, ... pipeline-model-parallel size: {p}"`` (``arguments.py``).

Pure: text in, records out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

GB = 10**9
MIB = 1 << 20

FIELDS = ("allocated", "max_allocated", "reserved", "max_reserved", "active", "max_active", "inactive",
          "max_inactive")
"""The byte fields of a report, in one name each whatever the log called them."""

_BRIDGE_NAMES = {
    "mem-allocated": "allocated", "mem-max-allocated": "max_allocated", "mem-reserved": "reserved",
    "mem-max-reserved": "max_reserved", "mem-active": "active", "mem-max-active": "max_active",
    "mem-inactive": "inactive", "mem-max-inactive": "max_inactive",
}
_MEGATRON_NAMES = {"allocated": "allocated", "max allocated": "max_allocated", "reserved": "reserved",
                   "max reserved": "max_reserved", "cached": "reserved", "max cached": "max_reserved"}

_REPORT = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \((GB|MB)\)((?:\s*\|[^|]*)+)")
_FIELD = re.compile(r"\|\s*([A-Za-z][\w -]*?):\s*([-+\d.eE]+|nan|inf)\s*(?=\||$)")
_THEORY = re.compile(r"Theoretical memory footprints: weight and optimizer=([\d.]+) MB"
                     r"(?:, activation=([\d.]+) MB, total=([\d.]+) MB)?")


@dataclass(frozen=True)
class MemoryReport:
    """One memory report line: bytes per field (None where the line lacks it), the iteration it was
    taken after, and the rounding of its figures in bytes (Bridge's 5 significant digits)."""

    source: str  # "bridge" | "megatron"
    rank: int
    iteration: int
    values: dict
    retries: Optional[int] = None
    allocation_count: Optional[int] = None
    rounding: dict = None

    def get(self, name: str) -> Optional[int]:
        return self.values.get(name)

    def to_dict(self) -> dict:
        return {"source": self.source, "rank": self.rank, "iteration": self.iteration,
                **{f"{k}_bytes": self.values.get(k) for k in FIELDS}, "retries": self.retries,
                "allocation_count": self.allocation_count,
                "rounding_bytes": dict(self.rounding or {})}


@dataclass(frozen=True)
class TheoreticalMemory:
    """Bridge's (Megatron's) formula estimate printed on rank 0, in bytes."""

    weight_and_optimizer: int
    activation: Optional[int]
    total: Optional[int]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _five_significant(value: float) -> int:
    """Half a unit of the fifth significant digit of ``value`` GB, in bytes: how far Bridge's rounding
    (``round(gigabytes, -floor(log10(gigabytes)) + 4)``) may have moved the figure."""
    if value == 0:
        return 0
    return int(0.5 * 10 ** (math.floor(math.log10(abs(value))) - 4) * GB)


def parse_report(text: str) -> Optional[MemoryReport]:
    """A Bridge or Megatron-LM memory report line in ``text``, or None. ValueError for a number that is
    not one (the caller names the file and line)."""
    match = _REPORT.search(text)
    if not match:
        return None
    rank, iteration, unit, body = int(match.group(1)), int(match.group(2)), match.group(3), match.group(4)
    values, rounding, retries, count = {}, {}, None, None
    for name, raw in _FIELD.findall(body):
        name = name.strip()
        number = float(raw)
        if unit == "GB":
            if name == "mem-alloc-retires":
                retries = int(number)
            elif name == "mem-allocated-count":
                count = int(number)
            elif name.endswith("-gigabytes") and name[:-len("-gigabytes")] in _BRIDGE_NAMES:
                field = _BRIDGE_NAMES[name[:-len("-gigabytes")]]
                values[field] = int(round(number * GB))
                rounding[field] = _five_significant(number)
        elif name in _MEGATRON_NAMES:
            values[_MEGATRON_NAMES[name]] = int(round(number * MIB))
    source = "bridge" if unit == "GB" else "megatron"
    return MemoryReport(source, rank, iteration, values, retries, count, rounding)


def parse_theoretical(text: str) -> Optional[TheoreticalMemory]:
    match = _THEORY.search(text)
    if not match:
        return None
    mb = [None if g is None else int(round(float(g) * MIB)) for g in match.groups()]
    return TheoreticalMemory(*mb)


_LAYOUT_PATTERNS = (
    ("tp", re.compile(r"> initialized tensor model parallel with size (\d+)")),
    ("pp", re.compile(r"> initialized pipeline model parallel with size (\d+)")),
    ("world", re.compile(r"using world size: (\d+)")),
    ("dp", re.compile(r"(?:^|[\s,])data-parallel size: (\d+)")),
    ("cp", re.compile(r"(?:^|[\s,])context-parallel size: (\d+)")),
    ("tp", re.compile(r"(?:^|, )tensor-model-parallel size: (\d+)")),
    ("pp", re.compile(r"(?:^|, )pipeline-model-parallel size: (\d+)")),
    *((size, re.compile(rf"^\s*{field}: (\d+)\s+\(Mcore default")) for size, field in (  # Bridge's config summary
        ("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"), ("cp", "context_parallel_size"),
        ("ep", "expert_model_parallel_size"), ("etp", "expert_tensor_parallel_size"))),
    ("dp", re.compile(r"> initialized HyperCommGrid with tp=\d+, pp=\d+, cp=\d+, dp=(\d+)")),
)
_USE_TP_PP_DP = re.compile(r"^\s*use_tp_pp_dp_mapping: True")


def parse_layout(text: str) -> list[tuple[str, int]]:
    """(size name, value) pairs a layout line states; ``("order", 1)`` for Bridge's tp-pp-dp mapping."""
    found = [(name, int(m.group(1))) for name, pattern in _LAYOUT_PATTERNS if (m := pattern.search(text))]
    if _USE_TP_PP_DP.search(text):
        found.append(("order", 1))
    return found
