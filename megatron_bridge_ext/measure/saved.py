"""The bytes autograd retains for backward, per storage, module and category."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Optional

import torch

from megatron_bridge_ext.measure.modules import ModuleStack, Models, as_model_list, in_backward


def default_category(name: str) -> str:
    """Category of a module by name: ``lora_input``, ``attention`` or ``other``.

    ``lora_input`` is LoRA-A of every LoRA-family adapter (``...adapter.linear_in``, and
    CanonicalLoRA's ``...adapter.adapter_q.linear_in`` and its k, v, up and gate siblings), whose
    saved input is what sequence-parallel LoRA shrinks; ``attention`` is everything inside a
    ``self_attention`` module except its adapters, so that LoRA savings and attention savings are
    not mixed.
    """
    parts = name.split(".")
    if parts[-1] == "linear_in" and "adapter" in parts[:-1]:
        return "lora_input"
    if "self_attention" in parts and "adapter" not in parts:
        return "attention"
    return "other"


def _storage_key(storage: torch.UntypedStorage) -> tuple[int, str]:
    """Identity of the memory a saved tensor keeps alive: its storage object (StorageImpl) and device.

    The storage object, not its data pointer: under ``FakeTensorMode`` (the estimate traces real
    layers on fake tensors) storages hold no data and every one reports data pointer 0, while each
    is still its own StorageImpl. For real tensors one allocation is one StorageImpl, so the count
    is the same either way.
    """
    return storage._cdata, str(storage.device)


@dataclasses.dataclass
class _SeenStorage:
    """One storage saved during the measurement. Holds a weak reference only: when autograd
    frees the storage, the address may be reused by a new storage, which must count again."""

    ref: weakref.ref
    modules: set[str]
    nbytes: int = 0
    """The bytes it was counted with (0 for a parameter's storage)."""
    first: str = ""
    """The module that saved it first, whose category it counts in."""
    released: bool = False
    """Released by resizing it to nothing while the graph still references it, and taken off the counts."""


@dataclasses.dataclass
class SavedActivations:
    """Bytes retained for backward, as counted by :class:`SavedActivationMeter`.

    Each storage counts with its full ``nbytes`` (a saved view keeps its whole base alive), as
    of when it was saved. Counts accumulate since the last reset: a storage freed meanwhile
    stays counted, so the figures are what the graphs built retained, not a live peak. A storage
    the forward released by resizing it to nothing while the graph still references it does not
    count: Megatron Core's ``CheckpointWithoutOutput`` discards its outputs so after the modules
    that consume them saved them (``tensor_parallel/random.py`` L847-848, selective recompute of
    ``layernorm`` and ``mla_up_proj``), and recomputes them in backward. The meter looks for such
    storages when its context ends and when it is read, so it must be read before backward
    restores them, or left first.

    * ``total_bytes``: every activation storage once.
    * ``by_category``: ``total_bytes`` split by the category of the FIRST module that saved each
      storage; sums exactly to ``total_bytes``.
    * ``by_module``: per module, each storage once per module. A storage saved by two modules
      (a LoRA-A and its base layer both saving the same layer input) counts in both, so these
      figures may sum to more than ``total_bytes``.
    * ``by_category_per_module``: the sum of ``by_module`` over the modules of each category,
      i.e. what the modules of a category saved without deduplication across modules. Use it to
      ask "how much does LoRA-A save", and ``by_category`` to ask "how much memory is it".
    * ``by_module_alone``: per module, the part of ``by_module`` in storages no other module saved:
      what would go if that module kept its tensors another way (the estimate's FP8 contract).
    * ``module_categories``: the category of each module in ``by_module``.
    * ``parameter_bytes``: storages of parameters and buffers that autograd referenced, each
      once; not activations, so not in ``total_bytes``.
    """

    total_bytes: int = 0
    by_category: dict[str, int] = dataclasses.field(default_factory=dict)
    by_module: dict[str, int] = dataclasses.field(default_factory=dict)
    by_module_alone: dict[str, int] = dataclasses.field(default_factory=dict)
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
        self._models = as_model_list(models)
        self._classifier = classifier
        self._modules = ModuleStack(self._models)
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._parameter_keys: set[tuple[int, str]] = set()
        self.steps: list[SavedActivations] = []
        self.reset()

    def __enter__(self) -> "SavedActivationMeter":
        # nn.Module's own methods: Megatron Core's DistributedDataParallel sets ``self.buffers = []``
        # (its grad buffers), which hides ``buffers()`` on the wrapper Bridge hands to forward_step.
        self._parameter_keys = {
            _storage_key(tensor.untyped_storage())
            for model in self._models
            for tensor in (*torch.nn.Module.parameters(model), *torch.nn.Module.buffers(model))
        }
        self._modules.install()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)
        self._hooks = None
        self._modules.remove()
        self._take_off_released()

    def reset(self) -> None:
        """Forget everything counted so far (``steps`` is kept)."""
        self._seen: dict[tuple[int, str], _SeenStorage] = {}
        self._result = SavedActivations()

    def result(self) -> SavedActivations:
        """A copy of the counts since the last reset."""
        self._take_off_released()
        return dataclasses.replace(
            self._result,
            by_category=dict(self._result.by_category),
            by_module=dict(self._result.by_module),
            by_module_alone=dict(self._result.by_module_alone),
            by_category_per_module=dict(self._result.by_category_per_module),
            module_categories=dict(self._result.module_categories),
        )

    def acting_as(self, name: str):
        """Attribute the saves made inside to module ``name`` (:meth:`ModuleStack.acting_as`)."""
        return self._modules.acting_as(name)

    def counted(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is counted as an activation (saved while active, not a parameter, not released)."""
        seen = self._seen.get(_storage_key(storage))
        return seen is not None and seen.ref() is storage and bool(seen.nbytes) and not seen.released

    def step(self) -> SavedActivations:
        """End a step: return its counts, keep them in ``steps``, and reset."""
        result = self.result()
        self.steps.append(result)
        self.reset()
        return result

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not in_backward():
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
            counted = 0 if key in self._parameter_keys else storage.nbytes()
            seen = self._seen[key] = _SeenStorage(weakref.ref(storage), set(), counted, module)
            self._add_storage(key, module, storage.nbytes())
        if key not in self._parameter_keys and module not in seen.modules:
            self._add_alone(seen.modules, module, storage.nbytes())
            seen.modules.add(module)
            self._add_module(module, storage.nbytes())

    def _take_off_released(self) -> None:
        """Take every counted storage that is still referenced but now holds nothing off each count it is in: the
        total and its first module's category, each module's figure, its module's own part when one module saved
        it alone."""
        for seen in self._seen.values():
            storage = seen.ref()
            if seen.released or not seen.nbytes or storage is None or storage.nbytes():
                continue
            seen.released = True
            modules = sorted(seen.modules)
            self._result.total_bytes -= seen.nbytes
            self._result.by_category[self._category(seen.first)] -= seen.nbytes
            for module in modules:
                self._result.by_module[module] -= seen.nbytes
                self._result.by_category_per_module[self._category(module)] -= seen.nbytes
            if len(modules) == 1:
                self._result.by_module_alone[modules[0]] -= seen.nbytes

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

    def _add_alone(self, earlier: set[str], module: str, nbytes: int) -> None:
        """Count a storage as ``module``'s alone while no other module saved it; a second module takes it off the
        first one's."""
        alone = self._result.by_module_alone
        if not earlier:
            alone[module] = alone.get(module, 0) + nbytes
        elif len(earlier) == 1:
            [first] = earlier
            alone[first] -= nbytes

    def _add_module(self, module: str, nbytes: int) -> None:
        category = self._category(module)
        self._result.by_module[module] = self._result.by_module.get(module, 0) + nbytes
        per_module = self._result.by_category_per_module
        per_module[category] = per_module.get(category, 0) + nbytes


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
