"""Measure what a training step keeps in memory and what tensor parallelism sends over the wire.

Two context managers, both attributing their observations to the innermost named module whose
forward is running (through global module forward hooks, shared in :class:`ModuleStack`):

* :class:`SavedActivationMeter` counts the bytes autograd retains for backward during forward
  passes: the tensors packed into the graph through ``torch.autograd.graph.saved_tensors_hooks``.
  This is the activation memory that peak-memory work (sequence-parallel LoRA input, selective
  recompute) shrinks, measured independently of allocator caching and of the device.
* :class:`CollectiveCounter` records every ``torch.distributed`` collective issued, including
  the aliases Megatron Core binds at import (``dist_all_gather_func``, ...), with its size,
  phase (forward/backward) and module, so that a change in communication volume shows up as a
  number rather than as a profile to read.

Both are measurement tools: enter them around the steps to measure, not around production runs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.modules import module as nn_module

ROOT = "<root>"
"""Name for work done outside every named module (or in the top-level model's own forward)."""

Models = Union[torch.nn.Module, Iterable[torch.nn.Module], None]


def _as_model_list(models: Models) -> list[torch.nn.Module]:
    if models is None:
        return []
    if isinstance(models, torch.nn.Module):
        return [models]
    return list(models)


def _in_backward() -> bool:
    """True while the autograd engine is running a node (backward functions and grad hooks)."""
    return torch._C._current_autograd_node() is not None


# --------------------------------------------------------------------------------------------
# Module attribution
# --------------------------------------------------------------------------------------------


def module_names(models: Models) -> dict[int, str]:
    """Qualified name of every module of ``models``, keyed by ``id(module)``.

    One model: the names of ``named_modules()``, its root mapped to :data:`ROOT`. Several models
    (e.g. virtual-pipeline chunks, which repeat the same names): each name is prefixed with the
    model's index (``"0.decoder.layers.0"``, root ``"0"``) so the chunks stay apart. A module
    shared by several places keeps its first name.
    """
    model_list = _as_model_list(models)
    names: dict[int, str] = {}
    for index, model in enumerate(model_list):
        for name, module in model.named_modules():
            if len(model_list) > 1:
                name = f"{index}.{name}" if name else str(index)
            names.setdefault(id(module), name or ROOT)
    return names


class ModuleStack:
    """Which named module's forward is running, innermost last, per thread.

    Installed as global forward pre/post hooks, so it sees every ``module(...)`` call without
    touching the model. Modules that are not named (not part of the given models) are ignored;
    a direct ``module.forward(...)`` call bypasses the hooks and is attributed to the caller.
    The post hook is registered with ``always_call`` so a forward that raises still pops.
    """

    def __init__(self, models: Models):
        self._models = _as_model_list(models)  # held so that the ids in _names stay valid
        self._names: dict[int, str] = {}
        self._local = threading.local()
        self._handles: list[Any] = []

    def install(self) -> None:
        """Name the modules as they are now (after any wrapping, e.g. adapters) and hook in."""
        self._names = module_names(self._models)
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._push),
            nn_module.register_module_forward_hook(self._pop, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def current(self) -> str:
        """Name of the innermost running named module, :data:`ROOT` outside all of them."""
        stack = self._stack()
        return stack[-1] if stack else ROOT

    def _stack(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _push(self, module: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._stack().append(name)

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        stack = self._stack()
        if name is not None and name in stack:
            # Pop down to this module: an inner forward that raised without its hook is discarded.
            while stack.pop() != name:
                pass


# --------------------------------------------------------------------------------------------
# Saved activations
# --------------------------------------------------------------------------------------------


def default_category(name: str) -> str:
    """Category of a module by name: ``lora_input``, ``attention`` or ``other``.

    ``lora_input`` is LoRA-A (``...adapter.linear_in``), whose saved input is what
    sequence-parallel LoRA shrinks; ``attention`` is everything inside a ``self_attention``
    module except its adapters, so that LoRA savings and attention savings are not mixed.
    """
    if name.endswith("adapter.linear_in"):
        return "lora_input"
    parts = name.split(".")
    if "self_attention" in parts and "adapter" not in parts:
        return "attention"
    return "other"


def _storage_key(storage: torch.UntypedStorage) -> tuple[int, str]:
    """Identity of the memory a saved tensor keeps alive: its storage's address and device."""
    return storage.data_ptr(), str(storage.device)


@dataclasses.dataclass
class _SeenStorage:
    """One storage saved during the measurement. Holds a weak reference only: when autograd
    frees the storage, the address may be reused by a new storage, which must count again."""

    ref: weakref.ref
    modules: set[str]


@dataclasses.dataclass
class SavedActivations:
    """Bytes retained for backward, as counted by :class:`SavedActivationMeter`.

    Each storage counts with its full ``nbytes`` (a saved view keeps its whole base alive), as
    of when it was saved. Counts accumulate since the last reset: a storage freed meanwhile
    stays counted, so the figures are what the graphs built retained, not a live peak.

    * ``total_bytes``: every activation storage once.
    * ``by_category``: ``total_bytes`` split by the category of the FIRST module that saved each
      storage; sums exactly to ``total_bytes``.
    * ``by_module``: per module, each storage once per module. A storage saved by two modules
      (a LoRA-A and its base layer both saving the same layer input) counts in both, so these
      figures may sum to more than ``total_bytes``.
    * ``by_category_per_module``: the sum of ``by_module`` over the modules of each category,
      i.e. what the modules of a category saved without deduplication across modules. Use it to
      ask "how much does LoRA-A save", and ``by_category`` to ask "how much memory is it".
    * ``module_categories``: the category of each module in ``by_module``.
    * ``parameter_bytes``: storages of parameters and buffers that autograd referenced, each
      once; not activations, so not in ``total_bytes``.
    """

    total_bytes: int = 0
    by_category: dict[str, int] = dataclasses.field(default_factory=dict)
    by_module: dict[str, int] = dataclasses.field(default_factory=dict)
    by_category_per_module: dict[str, int] = dataclasses.field(default_factory=dict)
    module_categories: dict[str, str] = dataclasses.field(default_factory=dict)
    parameter_bytes: int = 0

    def module_bytes(self, category: str) -> int:
        """Bytes saved by the modules of ``category``, without cross-module deduplication."""
        return self.by_category_per_module.get(category, 0)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable copy."""
        return dataclasses.asdict(self)


class SavedActivationMeter:
    """Counts the bytes autograd saves for backward while active.

    ``with SavedActivationMeter(model) as meter: loss = model(batch)`` then ``meter.result()``.
    For several steps call ``meter.step()`` after each forward: it returns that step's
    :class:`SavedActivations`, appends it to ``meter.steps`` and starts afresh.

    The pack hook returns a detached alias of the saved tensor: no copy and the same numerics.
    (Returning the tensor itself would make a saved output reference its own ``grad_fn``, a
    cycle that keeps the output alive after the graph is dropped.) Like any saved-tensor hook it
    disables autograd's in-place modification check on saved tensors while active.

    Only saves made during forward are counted: tensors saved while backward runs (activation
    recompute) live only for that node's backward. Saves handled by an inner
    ``saved_tensors_hooks`` (non-reentrant checkpointing, CPU offload) replace ours and are not
    seen, which is right for both: they are not retained as such.

    ``models``: the model (or model chunks) whose parameters and buffers are excluded and whose
    module names attribute the saves. ``classifier`` maps a module name to a category.
    """

    def __init__(self, models: Models = None, classifier: Callable[[str], str] = default_category):
        self._models = _as_model_list(models)
        self._classifier = classifier
        self._modules = ModuleStack(self._models)
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._parameter_keys: set[tuple[int, str]] = set()
        self.steps: list[SavedActivations] = []
        self.reset()

    def __enter__(self) -> "SavedActivationMeter":
        self._parameter_keys = {
            _storage_key(tensor.untyped_storage())
            for model in self._models
            for tensor in (*model.parameters(), *model.buffers())
        }
        self._modules.install()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)
        self._hooks = None
        self._modules.remove()

    def reset(self) -> None:
        """Forget everything counted so far (``steps`` is kept)."""
        self._seen: dict[tuple[int, str], _SeenStorage] = {}
        self._result = SavedActivations()

    def result(self) -> SavedActivations:
        """A copy of the counts since the last reset."""
        return dataclasses.replace(
            self._result,
            by_category=dict(self._result.by_category),
            by_module=dict(self._result.by_module),
            by_category_per_module=dict(self._result.by_category_per_module),
            module_categories=dict(self._result.module_categories),
        )

    def step(self) -> SavedActivations:
        """End a step: return its counts, keep them in ``steps``, and reset."""
        result = self.result()
        self.steps.append(result)
        self.reset()
        return result

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _in_backward():
            self._record(tensor)
        # Leaves (parameters) come back as themselves: autograd functions read and set attributes
        # on them (main_grad, grad_added_to_main_grad). Non-leaves are detached: returning a saved
        # output itself would tie it to its own grad_fn and keep it alive.
        return tensor if tensor.grad_fn is None and tensor.is_leaf else tensor.detach()

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = _storage_key(storage)
        module = self._modules.current()
        seen = self._seen.get(key)
        if seen is None or seen.ref() is None:
            seen = self._seen[key] = _SeenStorage(weakref.ref(storage), set())
            self._add_storage(key, module, storage.nbytes())
        if key not in self._parameter_keys and module not in seen.modules:
            seen.modules.add(module)
            self._add_module(module, storage.nbytes())

    def _category(self, module: str) -> str:
        categories = self._result.module_categories
        if module not in categories:
            categories[module] = self._classifier(module)
        return categories[module]

    def _add_storage(self, key: tuple[int, str], module: str, nbytes: int) -> None:
        """Count a storage seen for the first time, in the total or as a parameter."""
        if key in self._parameter_keys:
            self._result.parameter_bytes += nbytes
            return
        category = self._category(module)
        self._result.total_bytes += nbytes
        self._result.by_category[category] = self._result.by_category.get(category, 0) + nbytes

    def _add_module(self, module: str, nbytes: int) -> None:
        category = self._category(module)
        self._result.by_module[module] = self._result.by_module.get(module, 0) + nbytes
        per_module = self._result.by_category_per_module
        per_module[category] = per_module.get(category, 0) + nbytes


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


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
                phase="backward" if _in_backward() else "forward",
                module=self._modules.current(),
                function=name,
            )
        )
