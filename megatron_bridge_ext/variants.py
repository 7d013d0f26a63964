"""The memory-feature variants the demo and the benchmarks run side by side.

A variant is one choice of features applied to the same tiny model, weights and data: which
PEFT object to apply and which Megatron Core config fields to set. Each feature adds its own
entry here, and every table of the demo and benchmarks gains its row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_bridge_ext.tiny_model import TinyGPTShape, bridge_lora


def _always() -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    description: str
    make_peft: Callable[[TinyGPTShape], Any]
    config_overrides: dict[str, Any] = field(default_factory=dict)
    available: Callable[[], tuple[bool, str]] = _always


BASELINE = Variant(
    name="baseline",
    description="Megatron Bridge's LoRA as shipped (LoRA-A keeps the gathered [s, b, h] input)",
    make_peft=bridge_lora,
)

VARIANTS: dict[str, Variant] = {v.name: v for v in (BASELINE,)}


def select(names: list[str] | None) -> list[Variant]:
    """The named variants in the order given (all registered ones when ``names`` is empty)."""
    if not names:
        return list(VARIANTS.values())
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    return [VARIANTS[n] for n in names]
