"""``mbx plan`` imports Megatron Bridge without registering its diffusion model bridges.

Megatron Bridge 0.5.1 and 0.6.2 ``megatron/bridge/__init__.py`` (L16) run
``import megatron.bridge.diffusion.models`` so that ``AutoBridge`` knows the diffusion models
(Flux, Wan, ...) and the Hugging Face Auto classes of their ``config.json``. Any import of a Bridge
module runs that file first, and the diffusion packages (Megatron Energon, diffusers, their
inference pipelines) are about a fifth of the plan's import time. The plan estimates GPT models
only (a diffusion config is refused whether or not its bridge is registered), from a ``config.json``
through the language-model bridges of ``megatron.bridge.models`` or from a recipe that imports
what it uses.

The patch is an import hook (:mod:`.import_hooks`) on ``megatron.bridge`` only: while its
``__init__`` runs, that one statement binds ``megatron`` as it would and imports nothing. A later
``import megatron.bridge.diffusion.models`` imports them as usual. Only ``mbx plan`` applies it, for
its own process, before anything imports Bridge; never ``init()``, whose training scripts may
convert a diffusion checkpoint.
"""

from __future__ import annotations

import sys
from typing import Callable

from megatron_bridge_ext.patches import import_hooks
from megatron_bridge_ext.patches.base import Patch

TARGET_MODULE = "megatron.bridge"
SKIPPED = "megatron.bridge.diffusion.models"
_seen: list[str] = []
"""The skipped import, once the hooked ``__init__`` reached it (how the patch knows the structure held)."""


def _needed() -> tuple[bool, str]:
    if TARGET_MODULE in sys.modules:
        return False, f"{TARGET_MODULE} is already imported in this process"
    return True, (f"{TARGET_MODULE}'s __init__ imports {SKIPPED} (every diffusion bridge) before any Bridge module; "
                  "the plan builds GPT models only")


def _apply() -> Callable[[], None]:
    _seen.clear()

    def resolve(name: str, fromlist: tuple):
        if name != SKIPPED or fromlist:
            return None
        _seen.append(name)
        return sys.modules["megatron"]  # what the statement binds; the submodule stays unimported

    return import_hooks.scoped_imports([TARGET_MODULE], resolve)


def _refusal() -> str | None:
    """Bridge's ``__init__`` ran under the hook without the statement the patch skips: its structure changed
    (nothing was skipped; the plan is only slower)."""
    if TARGET_MODULE in sys.modules and not _seen:
        return f"{TARGET_MODULE}'s __init__ has no `import {SKIPPED}`; nothing skipped"
    return None


PATCH = Patch(
    name="bridge_plan_without_diffusion",
    target=f"{TARGET_MODULE}: import {SKIPPED}",
    distribution="megatron-bridge",
    versions=">=0.5.1,<=0.6.2",
    reason="every Bridge import registers the diffusion model bridges first, a fifth of mbx plan's imports; the plan "
           "builds GPT models only",
    applied_by="mbx plan, for its own process before it imports Bridge (an import hook, removed after the plan); "
               "never init() or mbx run",
    needed=_needed,
    do_apply=_apply,
    refusal=_refusal,
)
