"""Which named module's forward is running: the attribution shared by the meters."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable, Iterator, Union

import torch
from torch.nn.modules import module as nn_module

ROOT = "<root>"
"""Name for work done outside every named module (or in the top-level model's own forward)."""

Models = Union[torch.nn.Module, Iterable[torch.nn.Module], None]


def as_model_list(models: Models) -> list[torch.nn.Module]:
    if models is None:
        return []
    if isinstance(models, torch.nn.Module):
        return [models]
    return list(models)


def in_backward() -> bool:
    """True while the autograd engine is running a node (backward functions and grad hooks)."""
    return torch._C._current_autograd_node() is not None


def module_names(models: Models) -> dict[int, str]:
    """Qualified name of every module of ``models``, keyed by ``id(module)``.

    One model: the names of ``named_modules()``, its root mapped to :data:`ROOT`. Several models
    (e.g. virtual-pipeline chunks, which repeat the same names): each name is prefixed with the
    model's index (``"0.decoder.layers.0"``, root ``"0"``) so the chunks stay apart. A module
    shared by several places keeps its first name.
    """
    model_list = as_model_list(models)
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
        self._models = as_model_list(models)  # held so that the ids in _names stay valid
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

    @contextlib.contextmanager
    def acting_as(self, name: str) -> Iterator[None]:
        """Attribute what runs inside to ``name``, as if a module of that name were running (work a module's
        caller does on its behalf, such as the checkpoint that keeps a layer's inputs)."""
        stack = self._stack()
        stack.append(name)
        try:
            yield
        finally:
            while stack and stack.pop() != name:
                pass

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
