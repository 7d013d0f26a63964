"""Import hooks: how a patch changes an upstream module before it is imported, without importing it.

Users import Bridge's training entry points at the top of their script, so a patch that waits for
the module to be imported comes too late, and one that imports it early costs every script the
whole Bridge import. Both uses below go through one meta-path finder that wraps the loader of the
named modules only, so applying a patch costs nothing until upstream imports its module:

* :func:`scoped_imports`: while the top-level code of one of the modules runs, its ``import``
  statements ask ``resolve(name, fromlist)`` first, which may hand back a placeholder module.
  The placeholder never reaches ``sys.modules``: everything else in the process (Bridge's own
  ``safe_import`` checks included) still sees the package as absent.
* :func:`after_import`: a callback on the module object right after its top-level code ran (at
  once when the module is already imported), for patches that rebind a name in it.

:func:`placeholder_module` builds the stand-in for a package that is not installed: every
attribute is a class that raises a clear error when used, never at import.
"""

from __future__ import annotations

import builtins
import importlib.abc
import sys
import types
from typing import Callable, Iterable, Optional

Resolve = Callable[[str, tuple], Optional[types.ModuleType]]
"""``resolve(name, fromlist)`` -> the module an ``import`` statement gets instead, or None for the real one."""


class _LoaderHook(importlib.abc.MetaPathFinder):
    """Finds the named modules with the other finders, then runs their top-level code through ``around``."""

    def __init__(self, modules: Iterable[str], around: Callable[[types.ModuleType, Callable], None]) -> None:
        self.modules = frozenset(modules)
        self._around = around
        self._busy = False  # while asking the other finders (hooks on the same module then chain)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.modules or self._busy:
            return None
        self._busy = True
        try:
            spec = next((spec for finder in list(sys.meta_path) if finder is not self
                         for spec in [_find(finder, fullname, path, target)] if spec is not None), None)
        finally:
            self._busy = False
        if spec is None:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module  # a loader instance of this spec only: wrapping it touches nothing else
        spec.loader.exec_module = lambda module: self._around(module, run)
        return spec


def _find(finder, fullname, path, target):
    find = getattr(finder, "find_spec", None)
    return None if find is None else find(fullname, path, target)


def _install(hook: _LoaderHook) -> Callable[[], None]:
    sys.meta_path.insert(0, hook)

    def remove() -> None:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)

    return remove


def hooks_installed() -> int:
    """How many hooks of this module are on ``sys.meta_path`` (for tests and status reports)."""
    return sum(isinstance(finder, _LoaderHook) for finder in sys.meta_path)


def scoped_imports(modules: Iterable[str], resolve: Resolve) -> Callable[[], None]:
    """While one of ``modules`` executes its top-level code, let ``resolve`` answer its imports first.

    Only absolute imports are offered to ``resolve``. Returns the function that removes the hook;
    a module already imported is not affected.
    """

    def scoped_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0:
            substitute = resolve(name, tuple(fromlist or ()))
            if substitute is not None:
                return substitute
        return builtins.__import__(name, globals, locals, fromlist, level)

    def around(module: types.ModuleType, run: Callable) -> None:
        module.__builtins__ = dict(builtins.__dict__, __import__=scoped_import)
        try:
            run(module)
        finally:
            module.__builtins__ = builtins

    return _install(_LoaderHook(modules, around))


def after_import(module_name: str, callback: Callable[[types.ModuleType], None]) -> Callable[[], None]:
    """Call ``callback(module)`` once ``module_name`` is imported: now if it is, else right after its import.

    Returns the function that removes the hook (what the callback changed is the caller's to undo).
    """
    if module_name in sys.modules:
        callback(sys.modules[module_name])
        return lambda: None

    def around(module: types.ModuleType, run: Callable) -> None:
        run(module)
        callback(module)

    return _install(_LoaderHook({module_name}, around))


class _MissingMeta(type):
    """Every attribute of a placeholder class is another placeholder class; calling one raises."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(cls.__module__, f"{cls.__qualname__}.{name}", cls._message)

    def __call__(cls, *args, **kwargs):
        raise ImportError(cls._message.format(name=cls.__qualname__))


def _missing(module: str, qualname: str, message: str) -> type:
    placeholder = _MissingMeta(qualname.rsplit(".", 1)[-1], (), {"_message": message, "__module__": module})
    placeholder.__qualname__ = qualname
    return placeholder


def placeholder_module(name: str, message: str) -> types.ModuleType:
    """A stand-in for the missing module ``name``: each attribute is a class that raises ``ImportError(message)``
    when instantiated or called (``message`` may use ``{name}``, the attribute's dotted name)."""
    module = types.ModuleType(name)
    module.__doc__ = f"megatron-bridge-ext placeholder: {name} is not installed"

    def module_getattr(attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _missing(name, f"{name}.{attribute}", message)

    module.__getattr__ = module_getattr
    return module
