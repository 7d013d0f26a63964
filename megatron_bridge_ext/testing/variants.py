"""The one registry of memory-feature variants that the demo, the benchmarks, the device check and the tests run.

A variant is one choice of features applied to the same tiny model, weights and data, declared as flags:
``sequence_parallel_input_strategy`` and ``recompute_modules`` are
:class:`~megatron_bridge_ext.config.MemoryConfig`'s, and ``upstream_regather`` is Bridge's own
``LoRA(sequence_parallel_input_regather=True)``. Every variant is applied the way a user applies it:
Bridge's PEFT of the shape's kind (``TinyGPTShape.peft``), then
``MemoryConfig(...).apply``, which swaps in our PEFT class and sets Megatron Core's recompute fields;
nothing here sets those fields itself. Each feature adds its entry here, and every table of the demo and
benchmarks gains its row; a command picks its variants from here by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

from megatron_bridge_ext.peft import kinds
from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, bridge_lora, transformer_config


def _always(kind: str) -> tuple[bool, str]:
    return True, ""


class Applied(NamedTuple):
    """A variant on the tiny model: the PEFT object to apply and the Core config fields MemoryConfig changed."""

    peft: Any
    config: dict[str, Any]


@dataclass
class _TinyContainer:
    """The two parts of a Bridge ConfigContainer that MemoryConfig reads and sets for the tiny model:
    ``model`` (its Megatron Core TransformerConfig) and ``peft``."""

    model: Any
    peft: Any


@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    description: str
    sequence_parallel_input_strategy: Optional[str] = None
    """``MemoryConfig.sequence_parallel_input_strategy``: our PEFT class of the same kind with this strategy;
    None keeps Bridge's."""
    recompute_modules: Optional[tuple[str, ...]] = None
    """``MemoryConfig.recompute_modules``: selective recompute of these modules; None leaves recompute alone."""
    upstream_regather: bool = False
    """Bridge's own ``sequence_parallel_input_regather=True`` on its LoRA."""
    available: Callable[[str], tuple[bool, str]] = _always
    """Whether the variant runs for a PEFT kind, and why not."""

    def memory_config(self, *, expandable_segments: bool = True):
        """The MemoryConfig of the variant's flags; None when it sets none (Bridge's PEFT as configured)."""
        if self.sequence_parallel_input_strategy is None and self.recompute_modules is None:
            return None
        from megatron_bridge_ext.config import MemoryConfig

        modules = list(self.recompute_modules) if self.recompute_modules is not None else None
        return MemoryConfig(expandable_segments=expandable_segments,
                            sequence_parallel_input_strategy=self.sequence_parallel_input_strategy,
                            recompute_modules=modules)

    def apply_to_bridge(self, cfg):
        """Apply the variant to a Bridge ConfigContainer whose ``peft`` is Bridge's LoRA-family PEFT."""
        if self.upstream_regather:
            cfg.peft.sequence_parallel_input_regather = True
        memory = self.memory_config()
        return memory.apply(cfg) if memory is not None else None

    def apply(self, shape: TinyGPTShape, **config_fields) -> Applied:
        """The variant on the tiny model of ``shape`` (with extra Core ``config_fields``, passed to ``build_gpt``
        as well): MemoryConfig applied to Bridge's PEFT and the model's TransformerConfig, as to a recipe.

        Allocator settings stay out: the tiny model runs in this process, whose CUDA may have started.
        """
        extra = {"sequence_parallel_input_regather": True} if self.upstream_regather else {}
        container = _TinyContainer(transformer_config(shape, **config_fields), bridge_lora(shape, **extra))
        memory = self.memory_config(expandable_segments=False)
        changes = memory.apply(container).changes if memory is not None else []
        config = {c.field.removeprefix("model."): c.new for c in changes if c.field.startswith("model.")}
        return Applied(container.peft, config)


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
)
UPSTREAM_REGATHER = Variant(
    name="upstream_regather",
    description="Bridge's own LoRA(sequence_parallel_input_regather=True) (Bridge >= 0.6)",
    upstream_regather=True,
    available=_upstream_has_regather_flag,
)
REGATHER = Variant(
    name="regather",
    description="our regather: LoRA-A keeps the shard, all-gathers it again in backward",
    sequence_parallel_input_strategy="regather",
)
SHARD_LOCAL = Variant(
    name="shard_local",
    description="our shard-local LoRA-A: gathers the r x h weight and the s x b x r hidden, never the input",
    sequence_parallel_input_strategy="shard_local",
)
CORE_ATTN = Variant(
    name="core_attn",
    description="Bridge's PEFT with selective recompute of core attention (drops the s x s tensors of unfused attention)",
    recompute_modules=("core_attn",),
)
SHARD_LOCAL_CORE_ATTN = Variant(
    name="shard_local+core_attn",
    description="shard-local LoRA-A input and core_attn recompute together",
    sequence_parallel_input_strategy="shard_local",
    recompute_modules=("core_attn",),
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
