"""The LoRA-family PEFT kinds by name: Bridge's class, ours, and how each names its targets.

``lora``, ``dora`` and ``canonical_lora`` (the values of ``mbx bench memory --peft``). Importing
this module imports nothing of Bridge; the functions import the classes they return.
"""

from __future__ import annotations

import importlib
from typing import Iterable, Optional

KINDS = ("lora", "dora", "canonical_lora")

_CLASSES = {
    "lora": ("megatron.bridge.peft.lora", "megatron_bridge_ext.peft.lora", "LoRA"),
    "dora": ("megatron.bridge.peft.dora", "megatron_bridge_ext.peft.dora", "DoRA"),
    "canonical_lora": ("megatron.bridge.peft.canonical_lora", "megatron_bridge_ext.peft.canonical_lora",
                       "CanonicalLoRA"),
}

CANONICAL_TARGETS = {"linear_qkv": ("linear_q", "linear_k", "linear_v"),
                     "linear_fc1": ("linear_fc1_up", "linear_fc1_gate")}
"""CanonicalLoRA's target names for the fused layers; it refuses the fused names, and other layers keep theirs."""

_FUSED_LAYER = {name: fused for fused, names in CANONICAL_TARGETS.items() for name in names}


def check_kind(kind: str, setting: str) -> None:
    """Refuse an unknown kind, naming ``setting``."""
    if kind not in KINDS:
        raise ValueError(f"{setting}={kind!r} is not a LoRA-family PEFT kind; use one of {', '.join(KINDS)}")


def _class(kind: str, ours: bool) -> type:
    check_kind(kind, "kind")
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    bridge_module, our_module, name = _CLASSES[kind]
    return getattr(importlib.import_module(our_module if ours else bridge_module), name)


def bridge_class(kind: str) -> type:
    """Megatron Bridge's class of ``kind``."""
    return _class(kind, ours=False)


def our_class(kind: str) -> type:
    """megatron_bridge_ext's drop-in class of ``kind`` (a subclass of Bridge's)."""
    return _class(kind, ours=True)


def kind_of(peft) -> Optional[str]:
    """The kind of a PEFT object, Bridge's or ours; None when it is not LoRA-family."""
    return next((kind for kind in KINDS if isinstance(peft, bridge_class(kind))), None)


def target_names(kind: str, layers: Iterable[str]) -> list[str]:
    """The ``target_modules`` of ``kind`` that adapt ``layers`` (CanonicalLoRA: linear_q, _k, _v for ``linear_qkv``)."""
    check_kind(kind, "kind")
    if kind != "canonical_lora":
        return list(layers)
    return [name for layer in layers for name in CANONICAL_TARGETS.get(layer, (layer,))]


def targeted_layers(targets: Iterable[str]) -> set[str]:
    """The layer names that ``target_modules`` adapt (CanonicalLoRA's ``linear_q`` adapts ``linear_qkv``)."""
    return {_FUSED_LAYER.get(target, target) for target in targets}
