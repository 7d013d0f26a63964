"""Megatron Bridge's PEFT modules import without Transformer Engine.

Megatron Bridge 0.5.1-0.6.2 ``megatron/bridge/peft/lora_layers.py`` (and 0.5.1 ``lora.py``)
run ``import transformer_engine.pytorch as te`` at module level, so ``megatron.bridge.peft.lora``
cannot be imported on a machine without TE, although the local (non-TE) LoRA path never uses it.

The patch is an import hook (:mod:`.import_hooks`) scoped to those modules only: while their top-level code runs,
``import transformer_engine...`` resolves to a placeholder whose every attribute is a class that
raises a clear error when instantiated. Nothing else in the process sees the placeholder, so
``safe_import`` checks elsewhere keep reporting TE as absent. Only active when TE cannot be imported:
with TE installed, whether it imports is tried when those modules import it, not when the hook is
installed (``init()`` imports nothing), and an importable TE reaches them as it is.

:func:`import_bridge_peft` is how the package uses it: the hook is installed for the duration of
that one import and removed afterwards (accessing ``megatron_bridge_ext.peft.LoRA`` calls it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from typing import Callable

from megatron_bridge_ext import logs
from megatron_bridge_ext.patches import import_hooks
from megatron_bridge_ext.patches.base import APPLIED, Patch

TARGET_MODULES = ("megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora")
_MESSAGE = (
    "Transformer Engine is not installed, but {name} was used. Install megatron-bridge-ext[te] "
    "(transformer-engine[pytorch]) on a CUDA machine, or use Megatron Core's local layer spec."
)


def te_placeholder() -> types.ModuleType:
    """``transformer_engine`` as a placeholder; ``transformer_engine.pytorch`` is the same object."""
    root = import_hooks.placeholder_module("transformer_engine", _MESSAGE)
    root.pytorch = root
    return root


def te_installed() -> bool:
    """Whether a ``transformer_engine`` package is there at all (imports nothing)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _te_importable() -> bool:
    if not te_installed():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises RuntimeError for an empty meta package, OSError for missing CUDA libs
        return False
    return True


def _needed() -> tuple[bool, str]:
    """Imports nothing (``init()`` runs it before torch is imported). Not needed once TE is imported; needed
    where it is not installed, also after this process imported Bridge's PEFT modules through the hook (a
    fresh script that imports Bridge before ``megatron_bridge_ext.peft`` or ``init()`` still fails); and
    needed where it is installed but not yet imported, since only importing it tells whether it works: the
    hook tries that when Bridge's PEFT modules import it, and hands them the real TE when it imports."""
    if "transformer_engine.pytorch" in sys.modules:
        return False, "Transformer Engine is imported; Bridge's PEFT modules load as they are"
    if te_installed():
        return True, ("Transformer Engine is installed but not imported yet: Bridge's PEFT modules get it when it "
                      "imports, the placeholder when it does not (tried when they import it)")
    return True, ("Transformer Engine is not importable and Bridge's PEFT modules (reached by `import "
                  "megatron.bridge`) import it unconditionally: call megatron_bridge_ext.init() or import "
                  "megatron_bridge_ext.peft before importing Bridge")


def import_bridge_peft() -> None:
    """Import Megatron Bridge's PEFT modules; without TE through the hook, installed for this import only."""
    if all(name in sys.modules for name in TARGET_MODULES):
        return
    installed_here = not PATCH.applied and PATCH.apply(quiet=True)[0] == APPLIED
    try:
        with logs.quiet_bridge_import():
            for name in TARGET_MODULES:
                importlib.import_module(name)
    finally:
        if installed_here:
            PATCH.revert()


def _apply() -> Callable[[], None]:
    placeholder = te_placeholder()
    importable = functools.cache(_te_importable)  # tried once, at the first import of TE by a target module

    def resolve(name: str, fromlist: tuple):
        if name.split(".")[0] != "transformer_engine" or importable():
            return None
        return placeholder

    return import_hooks.scoped_imports(TARGET_MODULES, resolve)


PATCH = Patch(
    name="bridge_peft_without_te",
    target="megatron.bridge.peft.lora_layers: import transformer_engine.pytorch",
    distribution="megatron-bridge",
    versions=">=0.5.1,<=0.6.2",
    reason="Bridge's PEFT modules import Transformer Engine unconditionally; the local-spec LoRA path needs none of it",
    applied_by="megatron_bridge_ext.init() and mbx run (an import hook, kept: a recipe or `import megatron.bridge` "
               "after it imports); megatron_bridge_ext.peft (LoRA, DoRA, CanonicalLoRA) for its one import of "
               "Bridge's PEFT modules, then removed",
    needed=_needed,
    do_apply=_apply,
)
