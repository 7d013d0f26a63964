"""Megatron Bridge detects Transformer Engine truthfully when it is absent.

Megatron Core 0.19 defines its ``TE*`` wrapper classes even without TE (they derive from a
``MagicMock`` placeholder), so Bridge 0.6.2's ``safe_import_from(...)`` checks succeed and
``megatron.bridge.peft.utils.HAVE_TE`` (and ``module_matcher``'s flags) read True. ``LoRA.transform``
then runs ``isinstance(module, TEColumnParallelLinear)`` and fails with
``TypeError: isinstance() arg 2 must be a type...``. The patch sets every ``HAVE_TE*`` flag of those
modules to Megatron Core's own ``HAVE_TE`` (False); revert restores the original values.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable

from megatron_bridge_ext.patches import bridge_peft_without_te
from megatron_bridge_ext.patches.base import Patch

TARGET_MODULES = ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher")


def _core_has_te() -> bool:
    from megatron.core.extensions import transformer_engine as core_te

    return bool(core_te.HAVE_TE)


def _false_positive_flags() -> dict[str, list[str]]:
    """Per target module, the HAVE_TE* flags that claim TE is present."""
    found: dict[str, list[str]] = {}
    for module_name in TARGET_MODULES:
        module = importlib.import_module(module_name)
        names = [n for n, v in vars(module).items() if n.startswith("HAVE_TE") and v is True]
        if names:
            found[module_name] = names
    return found


def _bridge_peft_cannot_import() -> bool:
    """True while Bridge's PEFT modules still need bridge_peft_without_te to import."""
    if all(name in sys.modules for name in bridge_peft_without_te.TARGET_MODULES):
        return False
    peft_patch = bridge_peft_without_te.PATCH
    return not peft_patch.applied and peft_patch.in_range()[0] and peft_patch.needed()[0]


def _needed() -> tuple[bool, str]:
    if _bridge_peft_cannot_import():
        # Importing them now would fail half-way and leave megatron.bridge half-imported in sys.modules,
        # which breaks every later import of Bridge in this process (status_all() must change nothing).
        return True, ("Bridge's PEFT modules cannot be imported (to inspect their TE flags) without "
                      "bridge_peft_without_te; bridge_peft_without_te.import_bridge_peft() imports them")
    try:
        if _core_has_te():
            return False, "Transformer Engine is installed; Bridge's detection is correct"
        flags = _false_positive_flags()
    except Exception as exc:  # an import failure here is reported, not hidden
        return False, f"cannot inspect Bridge's TE detection: {type(exc).__name__}: {exc}"
    if not flags:
        return False, "Bridge already reports Transformer Engine as absent"
    listed = ", ".join(f"{m}.{n}" for m, names in flags.items() for n in names)
    return True, f"Megatron Core has no TE but Bridge reports it present ({listed})"


def _apply() -> Callable[[], None]:
    originals: list[tuple[object, str, object]] = []
    for module_name, names in _false_positive_flags().items():
        module = importlib.import_module(module_name)
        for name in names:
            originals.append((module, name, getattr(module, name)))
            setattr(module, name, False)

    def undo() -> None:
        for module, name, value in originals:
            setattr(module, name, value)

    return undo


PATCH = Patch(
    name="bridge_truthful_te_detection",
    target="megatron.bridge.peft.utils.HAVE_TE, megatron.bridge.peft.module_matcher.HAVE_TE*",
    distribution="megatron-bridge",
    versions=">=0.5.1,<=0.6.2",
    reason="Core's TE placeholders make Bridge believe TE is present; LoRA.transform then raises TypeError",
    applied_by="megatron_bridge_ext.peft's LoRA, DoRA and CanonicalLoRA when they transform a model; the "
               "harness (testing.tiny_model.apply_peft, testing.bridge.recipe.bridge_lora) before Bridge's PEFT runs",
    needed=_needed,
    do_apply=_apply,
)
