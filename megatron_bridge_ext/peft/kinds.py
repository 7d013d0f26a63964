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


def class_name(kind: str) -> str:
    """The class name of ``kind`` (``DoRA``), the same upstream and here; imports nothing."""
    check_kind(kind, "kind")
    return _CLASSES[kind][2]


def public_target(kind: str) -> str:
    """The ``_target_`` that names our class of ``kind`` in a Bridge override (``megatron_bridge_ext.peft.DoRA``)."""
    return f"megatron_bridge_ext.peft.{class_name(kind)}"


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


HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
"""Hugging Face Llama-style projection names and the Megatron Core layer that holds each."""

_CANONICAL_HF_TARGETS = {"q_proj": "linear_q", "k_proj": "linear_k", "v_proj": "linear_v", "o_proj": "linear_proj",
                         "gate_proj": "linear_fc1_gate", "up_proj": "linear_fc1_up", "down_proj": "linear_fc2"}

MEGATRON_TARGETS = frozenset({
    "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",  # GPT attention and MLP (dense and MoE experts)
    "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",  # MLA
    "linear_qkv_down_proj", "linear_q", "linear_kv", "linear_wq_b", "linear_wk", "linear_weights_proj",
    "in_proj", "out_proj", "router", "output_layer"})
"""Module names of Megatron Core's layer specs that a LoRA-family ``target_modules`` entry can name."""


def hf_target_fix(kind: str, target: str) -> Optional[str]:
    """The Megatron Core name to write for a Hugging Face-named ``target`` (``q_proj`` -> ``linear_qkv``), else None.

    Bridge matches a target against a module's own name, or its full dotted name with ``*`` wildcards;
    Megatron Core fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``, so HF names match
    nothing and Bridge only warns after the model is built. CanonicalLoRA keeps the separate names.
    """
    prefix, _, name = target.rpartition(".")
    mapping = _CANONICAL_HF_TARGETS if kind == "canonical_lora" else HF_TARGETS
    if name not in mapping:
        return None
    return f"{prefix}.{mapping[name]}" if prefix else mapping[name]


def is_megatron_target(kind: str, target: str) -> bool:
    """Whether ``target`` can match a module of a Megatron Core model: a known module name (CanonicalLoRA's
    split names included), or a pattern whose last dotted part has a wildcard (it cannot be judged unbuilt)."""
    name = target.rpartition(".")[2]
    canonical = set(_FUSED_LAYER) if kind == "canonical_lora" else set()
    return "*" in name or name in MEGATRON_TARGETS or name in canonical


def field_problem(name: str, value) -> Optional[str]:
    """Why a LoRA-family field's value cannot build adapters, as ``"{name}={value!r} ... Fix: ..."``, or None.

    Bridge's dataclasses take any value: ``dim=0`` builds zero-width adapters, ``dim="16"`` fails deep inside
    Megatron Core, and a ``target_modules`` string is iterated letter by letter (``"linear_qkv"`` as ``l``, ``i``,
    ...). ``dim`` is LoRA's rank, a whole number of 1 or more; ``alpha`` its scale, a positive number;
    ``target_modules`` a list of module names."""
    if name == "dim" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return f"dim={value!r} is not a whole number of 1 or more (LoRA's rank). Fix: write e.g. dim=16"
    if name == "alpha" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        return f"alpha={value!r} is not a positive number (LoRA's scale is alpha / dim). Fix: write e.g. alpha=32"
    if name == "target_modules":
        if isinstance(value, str):
            return (f"target_modules={value!r} is one string, which would be read letter by letter. Fix: write a "
                    f"list, target_modules=[{value!r}]")
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            return f"target_modules={value!r} is not a list of module names. Fix: write e.g. ['linear_qkv', 'linear_proj']"
    return None


CHECKED_FIELDS = ("dim", "alpha", "target_modules")
"""The fields :func:`field_problem` checks."""
