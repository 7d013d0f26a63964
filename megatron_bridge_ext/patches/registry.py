"""The ordered list of patches, and the functions that apply, revert and report them.

Features apply the patches they need where they need them (each patch's ``applied_by``);
:func:`apply_all` is for ``mbx patches --apply`` and tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.patches import (
    bridge_lora_te_norm_grad,
    bridge_override_peft_check,
    bridge_peft_without_te,
    bridge_plan_without_diffusion,
    bridge_prebuilt_dataset_helpers,
    bridge_pretrain_without_nvrx,
    bridge_recipe_hf_config,
    bridge_truthful_te_detection,
    core_local_norm_sequence_parallel,
    core_training_plan_without_modelopt,
)
from megatron_bridge_ext.patches.base import Patch, logger

# Order matters: Bridge's PEFT modules must import before their TE detection can be corrected.
PATCHES: tuple[Patch, ...] = (
    bridge_peft_without_te.PATCH,
    bridge_truthful_te_detection.PATCH,
    core_local_norm_sequence_parallel.PATCH,
    bridge_lora_te_norm_grad.PATCH,
    bridge_pretrain_without_nvrx.PATCH,
    bridge_prebuilt_dataset_helpers.PATCH,
    bridge_recipe_hf_config.PATCH,
    bridge_override_peft_check.PATCH,
    bridge_plan_without_diffusion.PATCH,
    core_training_plan_without_modelopt.PATCH,
)

TRAINING_ENTRY: tuple[Patch, ...] = (bridge_pretrain_without_nvrx.PATCH, bridge_prebuilt_dataset_helpers.PATCH)
"""What Bridge's ``pretrain``/``finetune`` need to import and start; import hooks, so applying them imports nothing."""

PLAN_IMPORTS: tuple[Patch, ...] = (bridge_plan_without_diffusion.PATCH, core_training_plan_without_modelopt.PATCH)
"""What ``mbx plan`` applies while it runs: imports that register or load what a plan never uses left out."""

INIT: tuple[Patch, ...] = (bridge_peft_without_te.PATCH, *TRAINING_ENTRY, bridge_lora_te_norm_grad.PATCH,
                           bridge_override_peft_check.PATCH)
"""What ``megatron_bridge_ext.init()`` and ``mbx run`` apply: Bridge importing without TE (``import megatron.bridge``
reaches its PEFT modules), the training entry points, the TE norm-gradient fix, for Bridge's own LoRA, DoRA and
CanonicalLoRA as much as ours, and the stop for PEFT overrides Bridge could not build. All import hooks: applying
them imports nothing."""


@dataclass(frozen=True)
class PatchStatus:
    name: str
    target: str
    versions: str
    status: str
    reason: str
    applied_by: str


def _report(patch: Patch, result: tuple[str, str]) -> PatchStatus:
    status, why = result
    return PatchStatus(patch.name, patch.target, f"{patch.distribution} {patch.versions}", status, why,
                       patch.applied_by)


def apply_all() -> list[PatchStatus]:
    """Apply every patch in order (idempotent) and report each one's status."""
    return [_report(patch, patch.apply()) for patch in PATCHES]


def apply_plan_imports() -> list[PatchStatus]:
    """Apply :data:`PLAN_IMPORTS` for the rest of the process and report each one (``mbx patches --apply``, before
    it imports Bridge: the hooks act only on an import still to come)."""
    return [_report(patch, patch.apply()) for patch in PLAN_IMPORTS]


def apply_training_entry() -> list[PatchStatus]:
    """Apply :data:`TRAINING_ENTRY` (idempotent), before or after the script imports Bridge; report each one."""
    return [_report(patch, patch.apply(quiet=True)) for patch in TRAINING_ENTRY]


def install_init_hooks() -> list[PatchStatus]:
    """Apply :data:`INIT` (idempotent) and install the TE norm-gradient run-time check; report each patch.

    Everything here is an import hook on a Bridge module, so it works whether the script imports Bridge
    before or after, and imports nothing now.
    """
    statuses = [_report(patch, patch.apply(quiet=True)) for patch in INIT]
    bridge_lora_te_norm_grad.install_check()
    return statuses


@contextlib.contextmanager
def plan_imports():
    """Apply :data:`PLAN_IMPORTS` for the block (import hooks: they act only if the block imports Bridge first),
    then remove the ones applied here; what the block imported stays as it was imported. A hook's refusal is known
    only once the block has imported what it targets: it is logged at WARNING then, as every refused patch is."""
    applied_here = [patch for patch in PLAN_IMPORTS if not patch.applied and patch.apply(quiet=True) and patch.applied]
    try:
        yield
    finally:
        for patch in reversed(applied_here):
            refused = patch.refusal()
            if refused:
                logger.warning("patch %s refused: %s", patch.name, refused)
            patch.revert()


def revert_all() -> None:
    """Revert every applied patch, last first."""
    for patch in reversed(PATCHES):
        patch.revert()


def status_all(patches: Optional[tuple[Patch, ...]] = None) -> list[PatchStatus]:
    """Each patch's status (of ``patches``, default all: :data:`PATCHES` as it is at the call), changing nothing."""
    return [_report(patch, patch.status()) for patch in (PATCHES if patches is None else patches)]
