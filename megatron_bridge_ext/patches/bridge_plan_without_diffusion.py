"""``mbx plan`` imports Megatron Bridge without its diffusion models and recipes.

Megatron Bridge 0.5.1 and 0.6.2 ``megatron/bridge/__init__.py`` (L16) run
``import megatron.bridge.diffusion.models`` so that ``AutoBridge`` knows the diffusion models
(Flux, Wan, ...), and ``megatron/bridge/recipes/__init__.py`` star-imports every recipe family,
the diffusion ones included (0.6.2: ``megatron.bridge.recipes.flux``, ``.wan`` and their ``h100``
packages; 0.5.1: ``megatron.bridge.diffusion.recipes.flux.flux`` and ``.wan.wan``). Any import of a
Bridge module runs the first file, any recipe the second; the diffusion packages bring Megatron
Energon, diffusers, ModelOpt (Bridge's checkpointing, reached by the Flux pipeline) and their
inference pipelines, about half of the plan's import time. The plan estimates GPT models only (a
diffusion config is refused whether or not its bridge is registered), from a ``config.json`` through
the language-model bridges of ``megatron.bridge.models`` or from a recipe that imports what it uses.

The patch is an import hook (:mod:`.import_hooks`) on those two ``__init__`` files only: while they
run, ``import megatron.bridge.diffusion.models`` binds ``megatron`` as it would and imports nothing,
and a diffusion recipe's ``from ... import *`` imports no name. A later import of any of them (a
diffusion recipe given by its module path) works as usual. Only ``mbx plan`` applies it, for its own
process, before anything imports Bridge; never ``init()``, whose training may use any of them.
"""

from __future__ import annotations

import sys
import types
from typing import Callable

from megatron_bridge_ext.patches import import_hooks
from megatron_bridge_ext.patches.base import Patch

TARGET_MODULE = "megatron.bridge"
RECIPES = "megatron.bridge.recipes"
SKIPPED = "megatron.bridge.diffusion.models"
DIFFUSION_RECIPES = ("megatron.bridge.recipes.flux", "megatron.bridge.recipes.wan", "megatron.bridge.diffusion")
_seen: list[str] = []
"""The imports skipped so far (how the patch knows the structure held)."""


def _needed() -> tuple[bool, str]:
    if TARGET_MODULE in sys.modules:
        return False, f"{TARGET_MODULE} is already imported in this process"
    return True, (f"{TARGET_MODULE}'s __init__ imports {SKIPPED} (every diffusion bridge) before any Bridge module, "
                  f"{RECIPES}'s every diffusion recipe; the plan builds GPT models only")


def _diffusion_recipe(name: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in DIFFUSION_RECIPES)


def _apply() -> Callable[[], None]:
    _seen.clear()

    def resolve(name: str, fromlist: tuple):
        if name == SKIPPED and not fromlist:
            _seen.append(name)
            return sys.modules["megatron"]  # what the statement binds; the submodule stays unimported
        if fromlist == ("*",) and _diffusion_recipe(name):
            _seen.append(name)
            return types.ModuleType(name)  # no names to import
        return None

    return import_hooks.scoped_imports([TARGET_MODULE, RECIPES], resolve)


def _refusal() -> str | None:
    """Bridge's ``__init__`` ran under the hook without the statement the patch skips: its structure changed
    (nothing was skipped; the plan is only slower)."""
    if TARGET_MODULE in sys.modules and SKIPPED not in _seen:
        return f"{TARGET_MODULE}'s __init__ has no `import {SKIPPED}`; nothing skipped"
    return None


PATCH = Patch(
    name="bridge_plan_without_diffusion",
    target=f"{TARGET_MODULE}: import {SKIPPED}; {RECIPES}: from <diffusion recipes> import *",
    distribution="megatron-bridge",
    versions=">=0.5.1,<=0.6.2",
    reason="every Bridge import registers the diffusion model bridges first, every recipe import brings the "
           "diffusion recipes, about half of mbx plan's imports; the plan builds GPT models only",
    applied_by="mbx plan, for its own process before it imports Bridge (an import hook, removed after the plan); "
               "never init() or mbx run",
    needed=_needed,
    do_apply=_apply,
    refusal=_refusal,
)
