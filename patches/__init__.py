"""Every change megatron-bridge-ext makes to upstream behaviour, one module each.

Installed as ``megatron_bridge_ext.patches``. Each patch module defines one ``Patch`` object
(target, version range, reason, ``needed()``, idempotent ``apply()``, ``revert()``); the
registry in :mod:`megatron_bridge_ext.patches.registry` applies them in order.
"""

from megatron_bridge_ext.patches.registry import PATCHES, PatchStatus, apply_all, revert_all, status_all

__all__ = ["PATCHES", "PatchStatus", "apply_all", "revert_all", "status_all"]
