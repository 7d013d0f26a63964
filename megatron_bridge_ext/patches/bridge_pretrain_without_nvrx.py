"""Megatron Bridge's training entry points import without nvidia-resiliency-ext.

Megatron Bridge 0.5.1 (``megatron/bridge/training/pretrain.py`` L16) and 0.6.2 (L19) run
``from nvidia_resiliency_ext.inprocess import CallWrapper`` at module level, for a type hint of
``_pretrain`` only. ``finetune.py`` imports ``pretrain``, so without that package neither entry point
can be imported. nvidia-resiliency-ext is a declared dependency of Bridge, but it is missing
wherever Bridge is installed without its dependencies (``--no-deps``, as on machines where its
CUDA-only dependencies do not build) and on platforms it has no wheels for.

The patch is an import hook (:mod:`.import_hooks`) on ``megatron.bridge.training.pretrain`` only:
while its top-level code runs, that one import gets a placeholder module whose ``CallWrapper``
raises a clear error if it is ever used. Bridge's other, guarded uses of nvidia-resiliency-ext
(in-process restart, straggler detection, fault tolerance) keep seeing it as absent. Applying it
imports nothing, so it can be applied before the training script imports Bridge.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Callable

from megatron_bridge_ext.patches import import_hooks
from megatron_bridge_ext.patches.base import Patch

TARGET_MODULE = "megatron.bridge.training.pretrain"
_IMPORT = ("nvidia_resiliency_ext.inprocess", ("CallWrapper",))
_MESSAGE = ("nvidia-resiliency-ext is not installed, but {name} was used (in-process restart, "
            "cfg.inprocess_restart). Install it with `pip install nvidia-resiliency-ext`, or turn "
            "cfg.inprocess_restart off.")


def _needed() -> tuple[bool, str]:
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        return False, "nvidia-resiliency-ext is installed; Bridge's pretrain.py imports it as it is"
    if TARGET_MODULE in sys.modules:
        return False, f"{TARGET_MODULE} is already imported in this process"
    return True, ("nvidia-resiliency-ext is not installed and Bridge's pretrain.py imports its CallWrapper "
                  "unconditionally (a type hint only)")


def _apply() -> Callable[[], None]:
    placeholder = import_hooks.placeholder_module(_IMPORT[0], _MESSAGE)

    def resolve(name: str, fromlist: tuple):
        return placeholder if (name, fromlist) == _IMPORT else None

    return import_hooks.scoped_imports([TARGET_MODULE], resolve)


PATCH = Patch(
    name="bridge_pretrain_without_nvrx",
    target=f"{TARGET_MODULE}: from nvidia_resiliency_ext.inprocess import CallWrapper",
    distribution="megatron-bridge",
    versions=">=0.5.1,<=0.6.2",
    reason="Bridge's pretrain.py (and so finetune.py) imports nvidia-resiliency-ext unconditionally for a type hint; "
           "without the package neither training entry point can be imported",
    applied_by="megatron_bridge_ext.init() (an import hook, before the script imports Bridge), and the demo's "
               "CPU runner for Bridge's loop",
    needed=_needed,
    do_apply=_apply,
)
