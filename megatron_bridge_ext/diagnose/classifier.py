"""Say whether an out-of-memory error came from fragmentation or capacity, and what to do next.

The input is the dictionary of ``torch.cuda.memory_stats()`` taken on the rank that ran out
(plus, when known, the device's total memory, the allocator settings and the failed request).
Pure: this module imports neither torch nor the device; :mod:`.handler` records the stats at the OOM.

Why these signals: before raising an OOM the caching allocator frees every cached segment it
can (whole free segments) and retries (``num_alloc_retries``). What it cannot free is free
memory inside segments that live blocks keep split, counted in
``inactive_split_bytes.all.current``. So at the OOM, reserved memory well above allocated
memory means free memory existed but not in one piece: fragmentation, which expandable
segments remove (they unmap free pages and map new ones at the end of the segment). When
reserved is close to allocated the live tensors themselves fill the device: capacity.

Thresholds (module constants, shown in every diagnosis):

* ``GAP_FRACTION = 0.10``: reserved - allocated >= 10% of reserved. The allocator's own
  rounding (512-byte blocks, 2 MiB small segments, 20 MiB rounding of 1-10 MiB requests) leaves
  a few percent of slack in a healthy run; 10% is clearly above that noise.
* ``INACTIVE_SPLIT_FRACTION = 0.05``: inactive split bytes >= 5% of reserved. This memory is
  free but unreleasable by construction; 5% of an 80 GB device (4 GB) exceeds most single
  requests of a training step, so holding it back is what made the request fail.
* ``MIN_GAP_BYTES = 256 MiB``: below this the gap cannot explain a failure worth acting on.

Fragmentation when (gap >= 10% of reserved or inactive split >= 5% of reserved) and gap >=
256 MiB; otherwise capacity. Allocation retries, a failed request smaller than the gap, and
expandable segments being off are reported as supporting evidence, not used to decide.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from megatron_bridge_ext.evidence import LEVERS, after_allocator, sources, step_text
from megatron_bridge_ext.sizes import GIB as GiB
from megatron_bridge_ext.sizes import MIB as MiB
from megatron_bridge_ext.sizes import SOLD_AS, gib_figure, sold_as_note, whole_gb

GAP_FRACTION = 0.10
INACTIVE_SPLIT_FRACTION = 0.05
MIN_GAP_BYTES = 256 * MiB

ALLOCATED = "allocated_bytes.all.current"
RESERVED = "reserved_bytes.all.current"
INACTIVE_SPLIT = "inactive_split_bytes.all.current"
RETRIES = "num_alloc_retries"
OOMS = "num_ooms"

NO_OOM = "no OOM recorded"
"""The class of stats taken when no out-of-memory error had happened (``num_ooms`` 0): the state, not a failure."""
NO_OOM_STEP = {"step": None, "name": "none", "action": "no out-of-memory error to act on: these stats show the state "
               "when they were taken; take them at the OOM to diagnose one", "cost": "none"}

DECISION_ORDER = LEVERS
"""The levers in the order to try them, cheapest first (:data:`megatron_bridge_ext.evidence.LEVERS`)."""

TABLE: dict[str, dict[str, str]] = {
    "fragmentation": {
        "cause": "free memory is held inside segments that live blocks keep split; no free piece fits the "
                 "request although their sum would",
        "confirm": "at the OOM reserved is well above allocated and inactive_split_bytes is large; "
                   "num_alloc_retries > 0; `mbx env` shows expandable_segments off",
        "fix": "expandable segments (step 1), no throughput cost",
    },
    NO_OOM: {
        "cause": "none: no out-of-memory error happened before these stats were taken (num_ooms is 0)",
        "confirm": "the stats' num_ooms counts every OOM the allocator raised since the process started",
        "fix": "none needed; to diagnose an OOM, take the stats at the error (OOMHandler, or "
               "torch.cuda.memory_stats() in an `except torch.OutOfMemoryError` block)",
    },
    "capacity": {
        "cause": "live tensors (weights, gradients, optimizer state, activations) need more than the device has",
        "confirm": "at the OOM allocated is close to reserved and to the device total; expandable segments "
                   "do not help; `mbx bench memory` shows where activation memory goes",
        "fix": "reduce the peak in the decision order: LoRA input under SP, selective recompute, "
               "parallelism, CPU offloading",
    },
}


@dataclass
class Diagnosis:
    kind: str  # "fragmentation" | "capacity"
    headline: str
    evidence: list[str]
    metrics: dict[str, Any]
    row: dict[str, str]
    next_step: dict[str, Any]
    decision_order: list[dict[str, Any]] = field(default_factory=lambda: [dict(s) for s in DECISION_ORDER])
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        lines = [self.headline, "evidence:"]
        lines += [f"  - {e}" for e in self.evidence]
        lines += ["diagnosis table:"] + [f"  {k + ':':8} {v}" for k, v in self.row.items()]
        step = self.next_step
        if step["step"] is None:
            lines.append(f"next step: {step['action']}")
        else:
            lines.append(f"next step ({step['step']} of {len(DECISION_ORDER)}, {step['name']}): {step_text(step)} "
                         f"[cost: {step['cost']}]")
        lines += [f"note: {n}" for n in self.notes]
        lines.append("decision order:")
        lines += [f"  {s['step']}. {s['name']}: {s['action']} [cost: {s['cost']}]" for s in self.decision_order]
        lines += [f"source of the figures: {source}" for source in sources(self.decision_order)]
        return "\n".join(lines)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "unknown"
    return f"{gib_figure(n)} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def _expandable_from(settings) -> Optional[bool]:
    """expandable_segments from an option string or a snapshot-style settings mapping."""
    if settings is None:
        return None
    if isinstance(settings, Mapping):
        value = settings.get("expandable_segments")
        return None if value is None else bool(value)
    from megatron_bridge_ext.levers.allocator.options import AllocConf

    return bool(AllocConf.parse(str(settings), "allocator settings").flag("expandable_segments"))


def classify(stats: Mapping[str, Any], *, total_memory: Optional[int] = None, allocator_settings=None,
             expandable_segments: Optional[bool] = None, request_bytes: Optional[int] = None) -> Diagnosis:
    """Classify one rank's OOM from its ``torch.cuda.memory_stats()`` dictionary.

    Raises ValueError naming the key and the fix when the input is not what torch reports.
    """
    if not isinstance(stats, Mapping):
        raise ValueError(f"memory stats must be a JSON object (torch.cuda.memory_stats()), got {type(stats).__name__}")
    missing = [k for k in (ALLOCATED, RESERVED) if k not in stats]
    if missing:
        raise ValueError(f"memory stats lack {missing}: give the dictionary of torch.cuda.memory_stats() taken on the "
                         "device that ran out of memory (it is empty before CUDA is initialised)")
    allocated, reserved = _count(stats, ALLOCATED), _count(stats, RESERVED)
    if reserved <= 0:
        raise ValueError(f"{RESERVED} is {reserved}: nothing to diagnose (backend:cudaMallocAsync reports zeros, and "
                         "stats taken after torch.cuda.empty_cache() lose the picture); take the stats at the OOM")
    if allocated > reserved:
        raise ValueError(f"{ALLOCATED} ({allocated}) is larger than {RESERVED} ({reserved}), which torch never "
                         "reports: the stats were edited or mixed from two dumps; take one torch.cuda.memory_stats()")
    inactive = _count(stats, INACTIVE_SPLIT, 0)
    if inactive > reserved - allocated:
        raise ValueError(f"{INACTIVE_SPLIT} ({inactive}) is larger than {RESERVED} - {ALLOCATED} "
                         f"({reserved - allocated}), which torch never reports; take one torch.cuda.memory_stats()")
    retries, ooms = _count(stats, RETRIES, 0), _count(stats, OOMS, 0)
    total_memory = _optional_size(total_memory, "total memory")
    request_bytes = _optional_size(request_bytes, "request_bytes")
    if total_memory is not None and total_memory < reserved:
        raise ValueError(_total_below_reserved(total_memory, reserved))
    if expandable_segments is not None and not isinstance(expandable_segments, bool):
        raise ValueError(f"expandable_segments={expandable_segments!r} must be true, false or absent")
    expandable = expandable_segments if expandable_segments is not None else _expandable_from(allocator_settings)
    gap = max(reserved - allocated, 0)
    gap_frac, inactive_frac = gap / reserved, inactive / reserved
    strong = []
    if gap_frac >= GAP_FRACTION:
        strong.append(f"reserved - allocated = {fmt_bytes(gap)} = {gap_frac:.1%} of reserved (threshold {GAP_FRACTION:.0%})")
    if inactive_frac >= INACTIVE_SPLIT_FRACTION:
        strong.append(f"inactive split blocks hold {fmt_bytes(inactive)} = {inactive_frac:.1%} of reserved "
                      f"(threshold {INACTIVE_SPLIT_FRACTION:.0%})")
    free_anywhere = gap + (total_memory - reserved if total_memory is not None else 0)
    too_big = request_bytes is not None and total_memory is not None and request_bytes > free_anywhere
    kind = "fragmentation" if strong and gap >= MIN_GAP_BYTES and not too_big else "capacity"

    evidence = list(strong) if kind == "fragmentation" else [
        f"reserved - allocated = {fmt_bytes(gap)} = {gap_frac:.1%} of reserved (fragmentation needs >= "
        f"{GAP_FRACTION:.0%} and >= {fmt_bytes(MIN_GAP_BYTES)})",
        f"inactive split blocks hold {fmt_bytes(inactive)} = {inactive_frac:.1%} of reserved "
        f"(fragmentation needs >= {INACTIVE_SPLIT_FRACTION:.0%})"]
    if retries:
        evidence.append(f"{retries} allocation {'retry' if retries == 1 else 'retries'} (cudaMalloc failed, the "
                        "allocator freed its cache and retried)")
    if too_big:
        evidence.insert(0, f"the failed request ({fmt_bytes(request_bytes)}) is larger than all free memory together "
                           f"({fmt_bytes(free_anywhere)}: reserved but unallocated plus unreserved), so no "
                           "allocator could have placed it")
    elif request_bytes is not None:
        relation = "smaller" if request_bytes <= gap else "larger"
        evidence.append(f"the failed request ({fmt_bytes(request_bytes)}) is {relation} than the reserved but "
                        f"unallocated memory ({fmt_bytes(gap)})")
    if total_memory:
        evidence.append(f"allocated = {allocated / total_memory:.1%} and reserved = {reserved / total_memory:.1%} of the "
                        f"device's {fmt_bytes(total_memory)}")
    state = {True: "on", False: "off", None: "unknown"}[expandable]
    evidence.append(f"expandable segments: {state}")

    notes = []
    if kind == "fragmentation":
        headline = (f"fragmentation: {fmt_bytes(gap)} reserved but unallocated at the OOM ({gap_frac:.1%} of "
                    f"{fmt_bytes(reserved)} reserved; {fmt_bytes(inactive)} in inactive split blocks); "
                    f"expandable segments {state}")
        next_step = DECISION_ORDER[0] if expandable is not True else after_allocator()
        if expandable is True:
            notes.append("expandable segments are already on: the fragmentation left comes from elsewhere "
                         "(private memory pools, CUDA graphs); reduce the peak next")
    else:
        of_total = f" of {fmt_bytes(total_memory)} device memory ({allocated / total_memory:.1%})" if total_memory else ""
        headline = (f"capacity: {fmt_bytes(allocated)} allocated{of_total} at the OOM; only {fmt_bytes(gap)} "
                    f"({gap_frac:.1%}) reserved but unallocated; expandable segments {state}")
        next_step = after_allocator()
        if expandable is not True:
            notes.append("expandable segments cost nothing and are worth turning on, but they do not fix a capacity OOM")
        if total_memory and reserved < 0.9 * total_memory:
            notes.append(f"{fmt_bytes(total_memory - reserved)} of the device is outside PyTorch's allocator "
                         "(CUDA context, NCCL buffers, other processes): check those too")
    sold_as = sold_as_note(total_memory, "--total-memory") if total_memory else None
    if sold_as:
        notes.append(sold_as)
    metrics = {
        "allocated_bytes": allocated, "reserved_bytes": reserved, "reserved_unallocated_bytes": gap,
        "reserved_unallocated_fraction": round(gap_frac, 4), "inactive_split_bytes": inactive,
        "inactive_split_fraction": round(inactive_frac, 4), "num_alloc_retries": retries, "num_ooms": ooms,
        "total_memory": total_memory, "request_bytes": request_bytes, "expandable_segments": expandable,
        "thresholds": {"gap_fraction": GAP_FRACTION, "inactive_split_fraction": INACTIVE_SPLIT_FRACTION,
                       "min_gap_bytes": MIN_GAP_BYTES},
    }
    if OOMS in stats and ooms == 0 and request_bytes is None:
        return Diagnosis(NO_OOM, f"no out-of-memory error is recorded in these stats (num_ooms 0): they show the "
                         f"state when they were taken, {fmt_bytes(allocated)} allocated and {fmt_bytes(reserved)} "
                         f"reserved ({fmt_bytes(gap)} of it unallocated, {gap_frac:.1%}); expandable segments {state}",
                         evidence, metrics, dict(TABLE[NO_OOM]), dict(NO_OOM_STEP),
                         notes=[f"an out-of-memory error at these figures would read as {kind}"] + notes)
    row = dict(TABLE[kind])
    if kind == "fragmentation" and expandable is True:
        row["fix"] = ("expandable segments are on already: reduce the peak in the decision order (LoRA input under "
                      "SP, selective recompute, parallelism, CPU offloading)")
    return Diagnosis(kind, headline, evidence, metrics, row, dict(next_step), notes=notes)


def _total_below_reserved(total_memory: int, reserved: int) -> str:
    """Why a total below the reserved bytes is refused, and the fix. A whole number of GB that would
    hold the reserved bytes as GiB is most likely a GPU's sales figure ("80GB"), which counts GiB."""
    gb = whole_gb(total_memory)
    if gb is not None and gb * GiB >= reserved:
        return (f"--total-memory {gb}GB is {fmt_bytes(total_memory)} (GB = 10^9 bytes), less than the "
                f"{fmt_bytes(reserved)} reserved; a GPU sold as \"{gb}GB\" holds about {gb} GiB ({SOLD_AS}). "
                f"Fix: --total-memory {gb}GiB, or the exact torch.cuda.get_device_properties(0)."
                "total_memory in bytes, e.g. 85520809984B")
    return (f"total memory {fmt_bytes(total_memory)} is less than the {fmt_bytes(reserved)} reserved: wrong device "
            "or units. Fix: give the device's total memory, torch.cuda.get_device_properties(0).total_memory "
            "(e.g. --total-memory 80GiB)")


def _count(stats: Mapping[str, Any], key: str, default: Optional[int] = None) -> int:
    """A non-negative whole number from the stats, or ValueError naming the key."""
    if key not in stats and default is not None:
        return default
    value = stats[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} is {value!r}; torch.cuda.memory_stats() reports a non-negative whole number there: "
                         "give the unedited dictionary")
    return value


def _optional_size(value, name: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} is {value!r}; it must be a positive whole number of bytes (or absent)")
    return value


_SIZE = r"([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)"
_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40}


def parse_oom_message(message: str) -> dict[str, Optional[int]]:
    """The failed request and device capacity from torch's OOM message (None where absent)."""
    def find(prefix: str) -> Optional[int]:
        match = re.search(prefix + _SIZE, message)
        return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None

    return {"request_bytes": find(r"Tried to allocate "), "total_capacity_bytes": find(r"total capacity of "),
            "free_bytes": find(r"of which ")}


def diagnose_data(data: Mapping[str, Any], *, total_memory: Optional[int] = None,
                  expandable_segments: Optional[bool] = None) -> Diagnosis:
    """Diagnose a ``torch.cuda.memory_stats()`` dictionary or an OOM report of :class:`OOMHandler` (parsed JSON)."""
    if "stats" not in data:
        return classify(data, total_memory=total_memory, expandable_segments=expandable_segments)
    allocator = data.get("allocator", {})  # an OOM report of OOMHandler
    if allocator is None:
        allocator = {}
    if not isinstance(allocator, dict):
        raise ValueError(f"allocator is {allocator!r}; an OOM report holds an object there")
    recorded = allocator.get("expandable_segments")
    if recorded is not None and not isinstance(recorded, bool):
        raise ValueError(f"allocator.expandable_segments is {recorded!r}; it must be true, false or null")
    stats, note = data["stats"], None
    if isinstance(stats, Mapping) and not (ALLOCATED in stats and RESERVED in stats):
        stats, note = _stats_from_message(data), "the report's stats are empty (" + (
            "the allocator reported none" if not stats else "they lack the allocated and reserved bytes") + \
            "): the figures are its stored OOM message's"
    diagnosis = classify(stats, total_memory=total_memory if total_memory is not None else data.get("total_memory"),
                         expandable_segments=expandable_segments if expandable_segments is not None else recorded,
                         request_bytes=data.get("request_bytes"))
    if note:
        diagnosis.notes.insert(0, note)
    return diagnosis


def _stats_from_message(report: Mapping[str, Any]) -> Mapping[str, Any]:
    """The allocated and reserved bytes of an OOM report's stored message (PyTorch's OOM wording, :mod:`.oom_text`)
    as memory stats, or the report's own (empty) stats when its message states no figures."""
    from megatron_bridge_ext.diagnose.oom_text import parse_allocator

    exception = report.get("exception")
    message = exception.get("message") if isinstance(exception, Mapping) else None
    event = parse_allocator(message) if isinstance(message, str) else None
    if event is None or event.reserved is None:
        return report["stats"]
    return {ALLOCATED: event.allocated, RESERVED: event.reserved, OOMS: 1}


def diagnose_file(path: str, *, total_memory: Optional[int] = None,
                  expandable_segments: Optional[bool] = None) -> Diagnosis:
    """Diagnose a JSON dump of ``torch.cuda.memory_stats()`` or an OOM report of :class:`OOMHandler`."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (memory_stats() or an OOM report), got {type(data).__name__}")
    try:
        return diagnose_data(data, total_memory=total_memory, expandable_segments=expandable_segments)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
