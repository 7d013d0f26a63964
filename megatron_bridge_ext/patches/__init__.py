"""Every change megatron-bridge-ext makes to upstream behaviour, one module each.

Each patch module defines one ``Patch`` object (target, version range, reason, which feature
applies it, ``needed()``, idempotent ``apply()``, ``revert()``); the registry in
:mod:`megatron_bridge_ext.patches.registry` lists them in order. Importing this package applies
nothing: each feature applies the patches it needs when it runs (``Patch.applied_by``).
"""

from megatron_bridge_ext.patches.registry import PATCHES, PatchStatus, apply_all, revert_all, status_all

__all__ = ["PATCHES", "PatchStatus", "apply_all", "revert_all", "status_all"]
