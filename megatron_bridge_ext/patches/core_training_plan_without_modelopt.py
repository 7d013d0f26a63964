"""``mbx plan`` imports Megatron-LM's training package without NVIDIA ModelOpt.

Megatron Bridge's utilities import ``megatron.training`` (``megatron/bridge/utils/common_utils.py``),
whose ``__init__`` imports ``training.py`` and ``checkpointing.py``. Megatron Core 0.18.2 and
0.19.2 ship both, and both import ModelOpt inside ``try`` blocks that fall back to
``has_nvidia_modelopt = False``: ``checkpointing.py`` (0.19.2 L69-76, 0.18.2 L66-73, on any
exception) together with ``megatron.post_training``, which the Core wheel does not ship, so without
it the flag is False whether or not ModelOpt imported; ``training.py`` on ``ImportError`` (in 0.19.2
also together with ``megatron.post_training``; in 0.18.2 alone, a flag only the training loop reads,
for distillation). Importing ModelOpt (its Hugging Face and diffusers plugins with it) is about a third
of the plan's import time, for a process that saves no checkpoint and runs no training step.

The patch is an import hook (:mod:`.import_hooks`) on those two modules only: while their top-level
code runs, an import of ``modelopt`` raises ``ImportError``, so they take their own fallback.
Everything else (Bridge's recipes, its distillation provider) imports ModelOpt as usual. It is
needed only where ``megatron.post_training`` is missing (a Megatron-LM source tree ships it and
keeps ModelOpt). Only ``mbx plan`` applies it, for its own process; never ``init()``, whose training
saves checkpoints.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Callable

from megatron_bridge_ext.patches import import_hooks
from megatron_bridge_ext.patches.base import Patch

TARGET_MODULES = ("megatron.training.checkpointing", "megatron.training.training")
_refused_imports: list[str] = []
"""The ModelOpt imports the hooked modules asked for (how the patch knows the structure held)."""


def _needed() -> tuple[bool, str]:
    if importlib.util.find_spec("modelopt") is None:
        return False, "ModelOpt is not installed; Megatron's training package imports without it"
    if _spec("megatron.post_training") is not None:
        return False, "megatron.post_training is installed: Megatron's training package uses ModelOpt with it"
    imported = [name for name in TARGET_MODULES if name in sys.modules]
    if imported:
        return False, f"{imported[0]} is already imported in this process"
    return True, ("Megatron's training package imports ModelOpt (for checkpoint state and distillation) whenever "
                  "Bridge is imported; the plan saves no checkpoint and runs no training step")


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except ImportError:  # its parent package is missing
        return None


def _apply() -> Callable[[], None]:
    _refused_imports.clear()

    def resolve(name: str, fromlist: tuple):
        if name.split(".")[0] != "modelopt":
            return None
        _refused_imports.append(name)
        raise ImportError(f"{name} is left out of this process by the patch core_training_plan_without_modelopt",
                          name=name)

    return import_hooks.scoped_imports(TARGET_MODULES, resolve)


def _refusal() -> str | None:
    """A hooked module ran without importing ModelOpt: its structure changed (nothing skipped, the plan is only
    slower)."""
    if any(name in sys.modules for name in TARGET_MODULES) and not _refused_imports:
        return f"{' and '.join(TARGET_MODULES)} import no ModelOpt at module level; nothing skipped"
    return None


PATCH = Patch(
    name="core_training_plan_without_modelopt",
    target="megatron.training.checkpointing: from modelopt.torch.opt.plugins import save_modelopt_state",
    distribution="megatron-core",
    versions=">=0.18.2,<=0.19.2",
    reason="Megatron's training package imports ModelOpt, a third of mbx plan's imports, for checkpoints and "
           "distillation the plan never uses; both imports have a fallback without it",
    applied_by="mbx plan, for its own process before it imports Bridge (an import hook, removed after the plan); "
               "never init() or mbx run",
    needed=_needed,
    do_apply=_apply,
    refusal=_refusal,
)
