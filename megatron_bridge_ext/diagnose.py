"""Say whether an out-of-memory error came from fragmentation or capacity, and what to do next.

The input is the dictionary of ``torch.cuda.memory_stats()`` taken on the rank that ran out
(plus, when known, the device's total memory, the allocator settings and the failed request).
Importing this module does not import torch; only the OOM handler touches it, at OOM time.

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
import logging
import os
import re
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional

log = logging.getLogger("megatron_bridge_ext.diagnose")

MiB = 1 << 20
GiB = 1 << 30
GAP_FRACTION = 0.10
INACTIVE_SPLIT_FRACTION = 0.05
MIN_GAP_BYTES = 256 * MiB

ALLOCATED = "allocated_bytes.all.current"
RESERVED = "reserved_bytes.all.current"
INACTIVE_SPLIT = "inactive_split_bytes.all.current"
RETRIES = "num_alloc_retries"
OOMS = "num_ooms"

REPORT_FORMAT = "megatron_bridge_ext.oom_report/1"
REPORT_DIR_ENV = "MBX_OOM_REPORT_DIR"

# The decision order: cheapest first. Costs are the measured ones on Llama3 70B SFT (32x H100,
# TP4 PP4 VPP5 DP2) where we have them.
DECISION_ORDER: tuple[dict[str, Any], ...] = (
    {"step": 1, "name": "allocator",
     "action": "turn on expandable segments: megatron_bridge_ext.init() first in the training script, "
               "configure_bridge_env(cfg) in a Bridge recipe, or `mbx run -- torchrun ...`",
     "cost": "none: fixed a fragmentation OOM at 58.8 GB peak on Llama3 70B with no throughput change"},
    {"step": 2, "name": "LoRA input under sequence parallelism",
     "action": 'megatron_bridge_ext.peft.LoRA(sequence_parallel_input_strategy="shard_local"): LoRA-A works on '
               "the local sequence shard instead of saving a gathered copy of its input",
     "cost": "LoRA with sequence parallelism only; measure the saving with `mbx bench memory`"},
    {"step": 3, "name": "selective recompute",
     "action": "recompute_granularity='selective' with recompute_modules, cheapest modules first",
     "cost": "`mlp` recompute: about -16% throughput for about 3 GB on Llama3 70B"},
    {"step": 4, "name": "parallelism",
     "action": "raise PP at the cost of DP, or double TP",
     "cost": "PP 4->8: -5.9% throughput; TP 4->8: -28.4% (Llama3 70B)"},
    {"step": 5, "name": "CPU offloading",
     "action": "cpu_offloading=True (activations and weights of some layers to host memory)",
     "cost": "only possible with PP = 1 (and without recompute, in Megatron Core)"},
)

TABLE: dict[str, dict[str, str]] = {
    "fragmentation": {
        "cause": "free memory is held inside segments that live blocks keep split; no free piece fits the "
                 "request although their sum would",
        "confirm": "at the OOM reserved is well above allocated and inactive_split_bytes is large; "
                   "num_alloc_retries > 0; `mbx env` shows expandable_segments off",
        "fix": "expandable segments (step 1), no throughput cost",
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
        lines.append(f"next step ({step['step']} of {len(DECISION_ORDER)}, {step['name']}): {step['action']} "
                     f"[cost: {step['cost']}]")
        lines += [f"note: {n}" for n in self.notes]
        lines.append("decision order:")
        lines += [f"  {s['step']}. {s['name']}: {s['action']} [cost: {s['cost']}]" for s in self.decision_order]
        return "\n".join(lines)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "unknown"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def _expandable_from(settings) -> Optional[bool]:
    """expandable_segments from an option string or a snapshot-style settings mapping."""
    if settings is None:
        return None
    if isinstance(settings, Mapping):
        value = settings.get("expandable_segments")
        return None if value is None else bool(value)
    from megatron_bridge_ext.allocator_conf import AllocConf

    return bool(AllocConf.parse(str(settings), "allocator settings").flag("expandable_segments"))


def classify(stats: Mapping[str, Any], *, total_memory: Optional[int] = None, allocator_settings=None,
             expandable_segments: Optional[bool] = None, request_bytes: Optional[int] = None) -> Diagnosis:
    """Classify one rank's OOM from its ``torch.cuda.memory_stats()`` dictionary."""
    missing = [k for k in (ALLOCATED, RESERVED) if k not in stats]
    if missing:
        raise ValueError(f"memory stats lack {missing}: give the dictionary of torch.cuda.memory_stats() taken on the "
                         "device that ran out of memory (it is empty before CUDA is initialised)")
    allocated, reserved = int(stats[ALLOCATED]), int(stats[RESERVED])
    if reserved <= 0:
        raise ValueError(f"{RESERVED} is {reserved}: nothing to diagnose (backend:cudaMallocAsync reports zeros, and "
                         "stats taken after torch.cuda.empty_cache() lose the picture); take the stats at the OOM")
    inactive = int(stats.get(INACTIVE_SPLIT, 0))
    retries, ooms = int(stats.get(RETRIES, 0)), int(stats.get(OOMS, 0))
    expandable = expandable_segments if expandable_segments is not None else _expandable_from(allocator_settings)
    gap = max(reserved - allocated, 0)
    gap_frac, inactive_frac = gap / reserved, inactive / reserved
    strong = []
    if gap_frac >= GAP_FRACTION:
        strong.append(f"reserved - allocated = {fmt_bytes(gap)} = {gap_frac:.1%} of reserved (threshold {GAP_FRACTION:.0%})")
    if inactive_frac >= INACTIVE_SPLIT_FRACTION:
        strong.append(f"inactive split blocks hold {fmt_bytes(inactive)} = {inactive_frac:.1%} of reserved "
                      f"(threshold {INACTIVE_SPLIT_FRACTION:.0%})")
    kind = "fragmentation" if strong and gap >= MIN_GAP_BYTES else "capacity"

    evidence = list(strong) if kind == "fragmentation" else [
        f"reserved - allocated = {fmt_bytes(gap)} = {gap_frac:.1%} of reserved (fragmentation needs >= "
        f"{GAP_FRACTION:.0%} and >= {fmt_bytes(MIN_GAP_BYTES)})",
        f"inactive split blocks hold {fmt_bytes(inactive)} = {inactive_frac:.1%} of reserved "
        f"(fragmentation needs >= {INACTIVE_SPLIT_FRACTION:.0%})"]
    if retries:
        evidence.append(f"{retries} allocation {'retry' if retries == 1 else 'retries'} (cudaMalloc failed, the "
                        "allocator freed its cache and retried)")
    if request_bytes is not None:
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
        next_step = DECISION_ORDER[0] if expandable is not True else DECISION_ORDER[1]
        if expandable is True:
            notes.append("expandable segments are already on: the fragmentation left comes from elsewhere "
                         "(private memory pools, CUDA graphs); reduce the peak next")
    else:
        of_total = f" of {fmt_bytes(total_memory)} device memory ({allocated / total_memory:.1%})" if total_memory else ""
        headline = (f"capacity: {fmt_bytes(allocated)} allocated{of_total} at the OOM; only {fmt_bytes(gap)} "
                    f"({gap_frac:.1%}) reserved but unallocated; expandable segments {state}")
        next_step = DECISION_ORDER[1]
        if expandable is not True:
            notes.append("expandable segments cost nothing and are worth turning on, but they do not fix a capacity OOM")
        if total_memory and reserved < 0.9 * total_memory:
            notes.append(f"{fmt_bytes(total_memory - reserved)} of the device is outside PyTorch's allocator "
                         "(CUDA context, NCCL buffers, other processes): check those too")
    metrics = {
        "allocated_bytes": allocated, "reserved_bytes": reserved, "reserved_unallocated_bytes": gap,
        "reserved_unallocated_fraction": round(gap_frac, 4), "inactive_split_bytes": inactive,
        "inactive_split_fraction": round(inactive_frac, 4), "num_alloc_retries": retries, "num_ooms": ooms,
        "total_memory": total_memory, "request_bytes": request_bytes, "expandable_segments": expandable,
        "thresholds": {"gap_fraction": GAP_FRACTION, "inactive_split_fraction": INACTIVE_SPLIT_FRACTION,
                       "min_gap_bytes": MIN_GAP_BYTES},
    }
    return Diagnosis(kind, headline, evidence, metrics, dict(TABLE[kind]), dict(next_step), notes=notes)


_SIZE = r"([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)"
_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40}


def parse_oom_message(message: str) -> dict[str, Optional[int]]:
    """The failed request and device capacity from torch's OOM message (None where absent)."""
    def find(prefix: str) -> Optional[int]:
        match = re.search(prefix + _SIZE, message)
        return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None

    return {"request_bytes": find(r"Tried to allocate "), "total_capacity_bytes": find(r"total capacity of "),
            "free_bytes": find(r"of which ")}


def diagnose_file(path: str, *, total_memory: Optional[int] = None,
                  expandable_segments: Optional[bool] = None) -> Diagnosis:
    """Diagnose a JSON dump of ``torch.cuda.memory_stats()`` or an OOM report of :class:`OOMHandler`."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (memory_stats() or an OOM report), got {type(data).__name__}")
    if isinstance(data.get("stats"), dict):  # an OOM report
        allocator = data.get("allocator") or {}
        return classify(data["stats"], total_memory=total_memory or data.get("total_memory"),
                        expandable_segments=expandable_segments if expandable_segments is not None
                        else allocator.get("expandable_segments"),
                        request_bytes=data.get("request_bytes"))
    return classify(data, total_memory=total_memory, expandable_segments=expandable_segments)


# --------------------------------------------------------------------------------------------
# OOM handler
# --------------------------------------------------------------------------------------------


def _is_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def write_atomic(path: str, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write through a temporary file in the same directory, then os.replace: never a half-written report."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class OOMHandler:
    """On ``torch.OutOfMemoryError``: record this rank's stats, write a JSON report, print the diagnosis.

    The original exception always propagates unchanged (same object, same traceback):
    ``__exit__`` returns False, and a failure while reporting is logged, never raised in its
    place. Use as a context manager, or :func:`oom_guard` as a decorator. ``stats_fn`` and
    ``total_memory_fn`` replace the CUDA queries (tests, other devices).
    """

    def __init__(self, report_dir: Optional[str] = None, *, rank: Optional[int] = None, device=None,
                 stats_fn: Optional[Callable[[], Mapping[str, Any]]] = None,
                 total_memory_fn: Optional[Callable[[], Optional[int]]] = None, stream=None):
        self.report_dir = report_dir or os.environ.get(REPORT_DIR_ENV, "oom_reports")
        self.rank, self.device, self.stream = rank, device, stream
        self.stats_fn, self.total_memory_fn = stats_fn, total_memory_fn
        self.report: Optional[dict[str, Any]] = None
        self.report_path: Optional[str] = None

    def __enter__(self) -> "OOMHandler":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and _is_oom(exc):
            try:
                self.handle(exc)
            except Exception:  # reporting must never replace the OOM
                log.exception("could not write the OOM report; the original OutOfMemoryError follows")
        return False

    def handle(self, exc: BaseException) -> str:
        import torch

        rank = self.rank if self.rank is not None else _rank(torch)
        device = self.device
        if device is None and self.stats_fn is None and torch.cuda.is_available():
            device = torch.cuda.current_device()
        stats = dict(self.stats_fn() if self.stats_fn else torch.cuda.memory_stats(device))
        parsed = parse_oom_message(str(exc))
        total = self.total_memory_fn() if self.total_memory_fn else _total_memory(torch, device)
        total = total or parsed["total_capacity_bytes"]
        allocator = _allocator_state(torch)
        report: dict[str, Any] = {
            "format": REPORT_FORMAT, "rank": rank, "local_rank": _int_env("LOCAL_RANK"),
            "world_size": _int_env("WORLD_SIZE"), "hostname": socket.gethostname(), "pid": os.getpid(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": _device_index(device),
            "exception": {"type": type(exc).__name__, "message": str(exc)},
            "request_bytes": parsed["request_bytes"], "total_memory": total, "allocator": allocator,
            "stats": stats, "diagnosis": None, "diagnosis_error": None, "snapshot": None,
        }
        try:
            diagnosis = classify(stats, total_memory=total, expandable_segments=allocator["expandable_segments"],
                                 request_bytes=parsed["request_bytes"])
            report["diagnosis"] = diagnosis.to_dict()
            text = diagnosis.format()
        except ValueError as error:
            report["diagnosis_error"] = str(error)
            text = f"no diagnosis: {error}"
        path = os.path.join(self.report_dir, f"oom_rank{rank}.json")
        snapshot_path = _write_snapshot(torch, path[:-len(".json")] + ".snapshot.pickle")
        report["snapshot"] = snapshot_path
        write_atomic(path, lambda f: json.dump(report, f, indent=2, default=str))
        self.report, self.report_path = report, path
        print(f"[rank {rank}] out of memory; report: {path}" + (f", snapshot: {snapshot_path}" if snapshot_path else "")
              + "\n" + text, file=self.stream or sys.stderr, flush=True)
        return path


def oom_guard(fn: Optional[Callable] = None, **handler_kwargs):
    """Decorator form of :class:`OOMHandler`, e.g. around Bridge's ``train_step``::

        import megatron.bridge.training.train as bridge_train
        bridge_train.train_step = oom_guard(bridge_train.train_step)
    """
    import functools

    def wrap(f: Callable) -> Callable:
        @functools.wraps(f)
        def guarded(*args, **kwargs):
            with OOMHandler(**handler_kwargs):
                return f(*args, **kwargs)
        return guarded

    return wrap(fn) if fn is not None else wrap


def _rank(torch) -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return _int_env("RANK") or 0


def _int_env(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value and value.lstrip("-").isdigit() else None


def _device_index(device) -> Optional[int]:
    if device is None or isinstance(device, int):
        return device
    return getattr(device, "index", None)


def _total_memory(torch, device) -> Optional[int]:
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).total_memory)


def _allocator_state(torch) -> dict[str, Any]:
    from megatron_bridge_ext.allocator_conf import effective, parse_version, VARIABLES

    state: dict[str, Any] = {name: os.environ.get(name) for name in VARIABLES}
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    state["torch_settings"] = getter() if getter else None
    try:
        conf = effective(os.environ, parse_version(torch.__version__))[1]
        state["expandable_segments"] = bool(conf.flag("expandable_segments"))
    except ValueError as error:
        state["expandable_segments"] = None
        state["error"] = str(error)
    return state


def _write_snapshot(torch, path: str) -> Optional[str]:
    """A memory snapshot, only when history recording is on (without it the snapshot has no traces)."""
    if not torch.cuda.is_available():
        return None
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if enabled is None or not enabled():
        return None
    import pickle

    snapshot = torch.cuda.memory._snapshot()
    write_atomic(path, lambda f: pickle.dump(snapshot, f), binary=True)
    return path
