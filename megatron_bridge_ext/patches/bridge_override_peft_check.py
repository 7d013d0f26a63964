"""A PEFT override that Bridge could not build stops the run with one line instead of going on as a dict.

Megatron Bridge's ``process_config_with_overrides`` (``megatron/bridge/training/utils/omegaconf_utils.py``,
0.5.1 and 0.6.2) instantiates a ``+peft._target_=...`` override; when the class refuses its fields
(``+peft.sequence_parallel_input_strategy=shard_lcoal``, a misspelt field of Bridge's own LoRA, ...)
Bridge logs a warning and leaves ``cfg.peft`` the plain dict of the override, and the script goes
on until ``finetune`` calls that dict, far from the typo.

The patch wraps ``process_config_with_overrides``: after upstream returns, a ``cfg.peft`` that is
still a dict with ``_target_`` ends the process with the class's own error as one line (the setting,
the bad value, the valid values), exit status 1, before any model is built. An import hook
(:func:`.import_hooks.after_import`) installs it when the script imports the module, so applying it
imports nothing; a script that bound the function before ``init()`` keeps upstream's.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

from megatron_bridge_ext.patches import import_hooks
from megatron_bridge_ext.patches.base import Patch

TARGET_MODULE = "megatron.bridge.training.utils.omegaconf_utils"
FUNCTION = "process_config_with_overrides"
_WRAPPED = "_mbx_peft_check"

log = logging.getLogger("megatron_bridge_ext.patches")


def stop_if_unbuilt(cfg) -> None:
    """Exit with one line when ``cfg.peft`` is a ``_target_`` dict Bridge did not build."""
    from megatron_bridge_ext.overrides import unbuilt_peft

    finding = unbuilt_peft(cfg)
    if finding is not None:
        raise SystemExit(f"megatron_bridge_ext: peft override not built: {finding.text()}")


def _wrap(original: Callable) -> Callable:
    def process_config_with_overrides(*args, **kwargs):
        cfg = original(*args, **kwargs)
        stop_if_unbuilt(cfg)
        return cfg

    process_config_with_overrides.__doc__ = original.__doc__
    process_config_with_overrides.__wrapped__ = original
    setattr(process_config_with_overrides, _WRAPPED, True)
    return process_config_with_overrides


def _needed() -> tuple[bool, str]:
    module = sys.modules.get(TARGET_MODULE)
    if module is not None and getattr(getattr(module, FUNCTION, None), _WRAPPED, False):
        return False, "already checked in this process"
    return True, ("Bridge's override parser leaves a PEFT override it cannot build as a dict in cfg.peft and "
                  "only logs a warning")


def _apply() -> Callable[[], None]:
    originals: list = []

    def install(module) -> None:
        original = getattr(module, FUNCTION, None)
        if original is None:
            log.warning("patch bridge_override_peft_check refused: %s has no %s (Bridge changed); PEFT overrides "
                        "Bridge cannot build are not stopped. Fix: check cfg.peft after the overrides yourself",
                        TARGET_MODULE, FUNCTION)
            return
        if getattr(original, _WRAPPED, False):
            return
        originals.append((module, original))
        setattr(module, FUNCTION, _wrap(original))

    remove_hook = import_hooks.after_import(TARGET_MODULE, install)

    def undo() -> None:
        remove_hook()
        for module, original in originals:
            setattr(module, FUNCTION, original)
        originals.clear()

    return undo


PATCH = Patch(
    name="bridge_override_peft_check",
    target=f"{TARGET_MODULE}.{FUNCTION}",
    distribution="megatron-bridge",
    versions=">=0.5.1",
    reason="a +peft override whose class refuses its fields (a misspelt LoRA-A strategy, say) is left a dict in "
           "cfg.peft with a warning, and the run goes on",
    applied_by="megatron_bridge_ext.init() and mbx run (an import hook, before the script imports Bridge's "
               "override utilities)",
    needed=_needed,
    do_apply=_apply,
)
