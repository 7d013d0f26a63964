"""Megatron Bridge's initialisation uses Megatron Core's prebuilt dataset helpers instead of rebuilding them.

Megatron Bridge 0.5.1 and 0.6.2 (``megatron/bridge/training/initialize.py`` L147, in
``initialize_megatron``) call Megatron Core's ``compile_helpers()`` on local rank 0, which runs
``make -C <megatron/core/datasets>`` and calls ``sys.exit(1)`` when make fails
(``megatron/core/datasets/utils.py``). The megatron-core wheels (0.18.2, 0.19.2) ship the compiled
``helpers_cpp`` extension but no Makefile, so with every pip-installed Megatron Core make finds
nothing to build and local rank 0 exits with status 1 before training starts.

The patch rebinds ``compile_helpers`` in Bridge's ``initialize`` module: when
``megatron.core.datasets.helpers_cpp`` imports, the build is skipped (there is nothing to build);
otherwise upstream's ``compile_helpers`` runs as before. It is applied through an import hook
(:mod:`.import_hooks`), so applying it imports nothing and it can be applied before the training
script imports Bridge; it is only needed when Core's datasets directory has no Makefile.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
from pathlib import Path
from typing import Callable, Optional

from megatron_bridge_ext.patches import import_hooks
from megatron_bridge_ext.patches.base import Patch

log = logging.getLogger("megatron_bridge_ext.patches")

TARGET_MODULE = "megatron.bridge.training.initialize"
PREBUILT = "megatron.core.datasets.helpers_cpp"


def core_datasets_dir() -> Optional[Path]:
    """Megatron Core's ``megatron/core/datasets`` directory, found without importing Megatron."""
    spec = importlib.util.find_spec("megatron")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "core" / "datasets"
        if (candidate / "utils.py").is_file():
            return candidate
    return None


def _prebuilt_files(directory: Path) -> list[str]:
    return sorted(p.name for suffix in importlib.machinery.EXTENSION_SUFFIXES
                  for p in directory.glob("helpers_cpp" + suffix))


def _needed() -> tuple[bool, str]:
    directory = core_datasets_dir()
    if directory is None:
        return False, "Megatron Core's datasets directory is not found"
    if (directory / "Makefile").is_file():
        return False, f"{directory} has a Makefile: Bridge's compile_helpers() builds the helpers as upstream intends"
    prebuilt = _prebuilt_files(directory)
    if not prebuilt:
        return False, f"{directory} has neither a Makefile nor a prebuilt helpers_cpp: nothing this patch can use"
    return True, (f"{directory} ships the prebuilt {prebuilt[0]} but no Makefile: Bridge's compile_helpers() "
                  "would run make there and exit with status 1")


def _skip_when_prebuilt(original: Callable[[], None]) -> Callable[[], None]:
    def compile_helpers() -> None:
        try:
            importlib.import_module(PREBUILT)
        except ImportError as exc:
            log.info("%s does not import (%s): building the dataset helpers as upstream does", PREBUILT, exc)
            original()
            return
        log.info("dataset helpers: the prebuilt %s imports, nothing to compile (patch bridge_prebuilt_dataset_helpers)",
                 PREBUILT)

    compile_helpers.__doc__ = "Megatron Core's compile_helpers, skipped when the prebuilt extension imports."
    compile_helpers.__wrapped__ = original
    return compile_helpers


def _apply() -> Callable[[], None]:
    rebound: list[tuple[object, Callable, Callable]] = []

    def rebind(initialize) -> None:
        original = initialize.compile_helpers
        initialize.compile_helpers = _skip_when_prebuilt(original)
        rebound.append((initialize, original, initialize.compile_helpers))

    remove_hook = import_hooks.after_import(TARGET_MODULE, rebind)

    def undo() -> None:
        remove_hook()
        for module, original, wrapper in rebound:
            if module.compile_helpers is wrapper:
                module.compile_helpers = original

    return undo


PATCH = Patch(
    name="bridge_prebuilt_dataset_helpers",
    target=f"{TARGET_MODULE}.compile_helpers (Megatron Core's make of megatron/core/datasets)",
    distribution="megatron-bridge",
    versions=">=0.5.1,<=0.6.2",
    reason="Bridge's initialize_megatron runs make in Megatron Core's datasets directory, which the megatron-core "
           "wheel ships prebuilt but without a Makefile: local rank 0 exits with status 1 at startup",
    applied_by="megatron_bridge_ext.init() (an import hook, before the script imports Bridge), and the demo's "
               "CPU runner for Bridge's loop",
    needed=_needed,
    do_apply=_apply,
)
