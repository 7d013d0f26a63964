"""Every ``torch.distributed`` collective issued, with its size, phase and module."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_bridge_ext.measure.modules import ModuleStack, Models, in_backward


@dataclasses.dataclass(frozen=True)
class _CollectiveSpec:
    """How to size one ``torch.distributed`` function: its normalised kind and the argument
    whose elements define the volume (a tensor or a list of tensors)."""

    kind: str
    sized_argument: str


# Volume convention, per rank and in elements: all_gather counts the gathered OUTPUT (the full
# tensor every rank ends up with), reduce_scatter the INPUT (the full tensor every rank
# contributes), all_reduce and broadcast the tensor, all_to_all what this rank sends. Hence an
# all_gather and the reduce_scatter that is its backward have the same size. Names missing from
# the installed torch are skipped (``*_single`` are the newer names of ``*_into_tensor``/``*_tensor``).
COLLECTIVES: dict[str, _CollectiveSpec] = {
    "all_gather_single": _CollectiveSpec("all_gather", "output_tensor"),
    "all_gather_into_tensor": _CollectiveSpec("all_gather", "output_tensor"),
    "_all_gather_base": _CollectiveSpec("all_gather", "output_tensor"),
    "all_gather": _CollectiveSpec("all_gather", "tensor_list"),
    "reduce_scatter_single": _CollectiveSpec("reduce_scatter", "input"),
    "reduce_scatter_tensor": _CollectiveSpec("reduce_scatter", "input"),
    "_reduce_scatter_base": _CollectiveSpec("reduce_scatter", "input"),
    "reduce_scatter": _CollectiveSpec("reduce_scatter", "input_list"),
    "all_reduce": _CollectiveSpec("all_reduce", "tensor"),
    "all_to_all_single": _CollectiveSpec("all_to_all", "input"),
    "all_to_all": _CollectiveSpec("all_to_all", "input_tensor_list"),
    "broadcast": _CollectiveSpec("broadcast", "tensor"),
}

ALIAS_MODULE_PREFIXES = ("megatron.",)
"""Loaded modules whose names start with these are scanned for names bound to a collective
(Megatron Core binds ``dist_all_gather_func``/``dist_reduce_scatter_func`` at import in
``tensor_parallel.mappings``, ``tensor_parallel.layers``, ``utils`` and others)."""


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective as issued by this rank. ``elements`` follows the convention of
    :data:`COLLECTIVES`; ``function`` is the ``torch.distributed`` function that was called."""

    kind: str
    elements: int
    dtype: torch.dtype
    phase: str
    module: str
    function: str

    @property
    def nbytes(self) -> int:
        return self.elements * self.dtype.itemsize

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dtype": str(self.dtype).removeprefix("torch.")}


def _tensors(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class CollectiveCounter:
    """Records the ``torch.distributed`` collectives issued while active.

    On enter, every module-level name bound to a function of :data:`COLLECTIVES` is rebound to
    a counting wrapper, in ``torch.distributed``, ``torch.distributed.distributed_c10d`` and
    every loaded module whose name starts with one of ``alias_prefixes`` (default
    :data:`ALIAS_MODULE_PREFIXES`); exit restores every binding. A call is counted once, at the outermost wrapper: a Megatron alias
    calling ``all_gather_into_tensor`` or ``_all_gather_base`` calling it in turn is one
    collective. A module imported while the counter is active may bind a wrapper; after exit
    the wrapper only forwards the call.

    ``phase`` is ``"backward"`` while the autograd engine runs (backward functions, grad hooks)
    and ``"forward"`` otherwise. ``module`` is the innermost named module of ``models`` whose
    forward is running; backward runs outside module forwards, so its calls go to :data:`ROOT`
    (except during activation recompute, which runs forwards again).
    """

    def __init__(
        self, models: Models = None, alias_prefixes: tuple[str, ...] = ALIAS_MODULE_PREFIXES
    ):
        self._modules = ModuleStack(models)
        self._alias_prefixes = alias_prefixes
        self._local = threading.local()
        self._active = False
        self._restore: list[tuple[object, str, Any]] = []
        self.calls: list[CollectiveCall] = []

    def __enter__(self) -> "CollectiveCounter":
        self._modules.install()
        wrappers = {
            id(function): self._wrap(name, function)
            for name, function in ((name, getattr(dist, name, None)) for name in COLLECTIVES)
            if function is not None
        }
        for module in self._binding_modules():
            for attribute, value in list(vars(module).items()):
                wrapper = wrappers.get(id(value))
                if wrapper is not None:
                    self._restore.append((module, attribute, value))
                    setattr(module, attribute, wrapper)
        self._active = True
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._active = False
        for module, attribute, value in reversed(self._restore):
            setattr(module, attribute, value)
        self._restore = []
        self._modules.remove()

    def reset(self) -> None:
        """Forget the calls recorded so far."""
        self.calls = []

    def elements_by_kind(self, phase: Optional[str] = None) -> dict[str, int]:
        """Total elements per kind, optionally for one phase."""
        totals: dict[str, int] = defaultdict(int)
        for call in self.select(phase=phase):
            totals[call.kind] += call.elements
        return dict(totals)

    def elements_by_module(self, phase: Optional[str] = None) -> dict[str, dict[str, int]]:
        """Total elements per module, then per kind."""
        totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for call in self.select(phase=phase):
            totals[call.module][call.kind] += call.elements
        return {module: dict(kinds) for module, kinds in totals.items()}

    def max_elements(self, kind: Optional[str] = None) -> int:
        """Elements of the largest single collective (of ``kind``); 0 when there is none."""
        return max((call.elements for call in self.select(kind=kind)), default=0)

    def total_elements(self) -> int:
        return sum(call.elements for call in self.calls)

    def as_dict(self) -> dict[str, Any]:
        """Summaries and calls, JSON-serialisable."""
        return {
            "total_elements": self.total_elements(),
            "max_elements": self.max_elements(),
            "elements_by_kind": self.elements_by_kind(),
            "elements_by_phase": {phase: self.elements_by_kind(phase) for phase in ("forward", "backward")},
            "elements_by_module": self.elements_by_module(),
            "calls": [call.as_dict() for call in self.calls],
        }

    def select(self, kind: Optional[str] = None, phase: Optional[str] = None) -> list[CollectiveCall]:
        """The recorded calls of ``kind`` and ``phase`` (None: any), in issue order."""
        return [
            call
            for call in self.calls
            if (kind is None or call.kind == kind) and (phase is None or call.phase == phase)
        ]

    def _binding_modules(self) -> list[object]:
        loaded = [
            module
            for name, module in list(sys.modules.items())
            if module is not None and name.startswith(self._alias_prefixes)
        ]
        return [dist, dist.distributed_c10d, *loaded]

    def _wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """A counting stand-in for ``function``. The per-thread ``inside`` flag makes a call that
        reaches another wrapped function (alias -> public -> ``*_single``) count only once."""
        spec = COLLECTIVES[name]
        signature = inspect.signature(function)

        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self._active or getattr(self._local, "inside", False):
                return function(*args, **kwargs)
            self._local.inside = True
            try:
                sized = signature.bind(*args, **kwargs).arguments[spec.sized_argument]
                self._record(name, spec.kind, _tensors(sized))
                return function(*args, **kwargs)
            finally:
                self._local.inside = False

        return counted

    def _record(self, name: str, kind: str, tensors: list[torch.Tensor]) -> None:
        self.calls.append(
            CollectiveCall(
                kind=kind,
                elements=sum(tensor.numel() for tensor in tensors),
                dtype=tensors[0].dtype,
                phase="backward" if in_backward() else "forward",
                module=self._modules.current(),
                function=name,
            )
        )
