"""The memory-feature variants the demo and the benchmarks run side by side.

A variant is one choice of features applied to the same tiny model, weights and data: which
PEFT object to apply and which Megatron Core config fields to set. Each feature adds its own
entry here, and every table of the demo and benchmarks gains its row. The PEFT kind (LoRA, DoRA,
CanonicalLoRA) is the shape's (``TinyGPTShape.peft``): every variant builds that kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, bridge_lora, peft_fields
from megatron_bridge_ext.peft import kinds


def _always(kind: str) -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    description: str
    make_peft: Callable[[TinyGPTShape], Any]
    config_overrides: dict[str, Any] = field(default_factory=dict)
    available: Callable[[str], tuple[bool, str]] = _always
    """Whether the variant runs for a PEFT kind, and why not."""


def _ours(strategy: str) -> Callable[[TinyGPTShape], Any]:
    def make(shape: TinyGPTShape):
        return kinds.our_class(shape.peft)(**peft_fields(shape), sequence_parallel_input_strategy=strategy)

    return make


UPSTREAM_REGATHER_SINCE = "0.6.0"
"""The first Megatron Bridge release with ``LoRA.sequence_parallel_input_regather`` (Bridge PR #4581)."""


def _upstream_has_regather_flag(kind: str) -> tuple[bool, str]:
    """From the kind and the installed version, so that checking the options imports nothing heavy."""
    from packaging.version import Version

    from megatron_bridge_ext.versions import installed_version

    if kind != "lora":
        return False, f"Bridge's {kinds.class_name(kind)} has no sequence_parallel_input_regather (only its LoRA has)"
    version = installed_version("megatron-bridge")
    if version is not None and version >= Version(UPSTREAM_REGATHER_SINCE):
        return True, ""
    return False, f"Megatron Bridge {version} has no sequence_parallel_input_regather (new in {UPSTREAM_REGATHER_SINCE})"


BASELINE = Variant(
    name="baseline",
    description="Megatron Bridge's PEFT as shipped (LoRA-A keeps the gathered [s, b, h] input)",
    make_peft=bridge_lora,
)
UPSTREAM_REGATHER = Variant(
    name="upstream_regather",
    description="Bridge's own LoRA(sequence_parallel_input_regather=True) (Bridge >= 0.6)",
    make_peft=lambda shape: bridge_lora(shape, sequence_parallel_input_regather=True),
    available=_upstream_has_regather_flag,
)
REGATHER = Variant(
    name="regather",
    description="our regather: LoRA-A keeps the shard, all-gathers it again in backward",
    make_peft=_ours("regather"),
)
SHARD_LOCAL = Variant(
    name="shard_local",
    description="our shard-local LoRA-A: gathers the r x h weight and the s x b x r hidden, never the input",
    make_peft=_ours("shard_local"),
)

SELECTIVE_CORE_ATTN = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
CORE_ATTN = Variant(
    name="core_attn",
    description="Bridge's PEFT with selective recompute of core attention (drops the s x s tensors of unfused attention)",
    make_peft=bridge_lora,
    config_overrides=SELECTIVE_CORE_ATTN,
)
SHARD_LOCAL_CORE_ATTN = Variant(
    name="shard_local+core_attn",
    description="shard-local LoRA-A input and core_attn recompute together",
    make_peft=_ours("shard_local"),
    config_overrides=SELECTIVE_CORE_ATTN,
)

VARIANTS: dict[str, Variant] = {
    v.name: v for v in (BASELINE, UPSTREAM_REGATHER, REGATHER, SHARD_LOCAL, CORE_ATTN, SHARD_LOCAL_CORE_ATTN)
}


def select(names: list[str] | None, kind: str = "lora") -> list[Variant]:
    """The named variants in the order given (all available ones when ``names`` is empty), for PEFT ``kind``."""
    if not names:
        return [v for v in VARIANTS.values() if v.available(kind)[0]]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    chosen = [VARIANTS[n] for n in names]
    for variant in chosen:
        ok, why = variant.available(kind)
        if not ok:
            raise ValueError(f"variant {variant.name!r} is not available: {why}")
    return chosen
