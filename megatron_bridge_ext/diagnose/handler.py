"""The runtime side of the OOM diagnosis: on ``torch.OutOfMemoryError``, record this rank's state and explain it.

The report (``oom_rank<N>.json``) holds ``torch.cuda.memory_stats()``, the allocator settings, the
failed request and the diagnosis of :func:`megatron_bridge_ext.diagnose.classifier.classify`;
``mbx diagnose`` reads it back.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Optional

from megatron_bridge_ext.levers.allocator import runtime
from megatron_bridge_ext.diagnose.classifier import classify, parse_oom_message
from megatron_bridge_ext.diagnose.events import classify_message
from megatron_bridge_ext.diagnose.oom_text import parse_allocator

log = logging.getLogger("megatron_bridge_ext.diagnose")

REPORT_FORMAT = "megatron_bridge_ext.oom_report/1"
REPORT_DIR_ENV = "MBX_OOM_REPORT_DIR"


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
        allocator = runtime.state()
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
        headline = _headline(rank, str(exc), allocator["expandable_segments"])
        report["headline"] = headline
        path = os.path.join(self.report_dir, f"oom_rank{rank}.json")
        snapshot_path = _write_snapshot(torch, path[:-len(".json")] + ".snapshot.pickle")
        report["snapshot"] = snapshot_path
        write_atomic(path, lambda f: json.dump(report, f, indent=2, default=str))
        self.report, self.report_path = report, path
        print(f"[rank {rank}] out of memory; report: {path}" + (f", snapshot: {snapshot_path}" if snapshot_path else "")
              + ("\n" + headline if headline else "") + "\n" + text, file=self.stream or sys.stderr, flush=True)
        return path


def _headline(rank: int, message: str, expandable) -> Optional[str]:
    """The headline ``mbx diagnose`` prints for this OOM message in a log (rank, class, numbers, next step)."""
    from megatron_bridge_ext.diagnose.report import Failure

    event = parse_allocator(message)
    if event is None:
        return None
    return Failure(rank, classify_message(event, expandable=expandable), "").headline()


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
