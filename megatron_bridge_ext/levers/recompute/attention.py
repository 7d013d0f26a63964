"""Selective activation recompute of ``core_attn``: which attention a model has and what recomputing it saves.

Megatron Core recomputes the modules named in ``recompute_modules`` when
``recompute_granularity="selective"``. For ``core_attn`` the gain depends on the attention kernel:

* unfused attention (Megatron Core's local ``DotProductAttention``, or TE with the unfused backend)
  materialises the [b, a/t, s, s] softmax output (and, with attention dropout, its mask and output):
  per layer 5*a*s^2*b bytes in 16-bit with dropout, divided by t (Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", section 4); recompute drops them.
* fused/flash attention (TE's fused or flash backends) keeps no s x s matrix: recomputing it costs
  time for little or no memory (Bridge measured -0.01% memory for +3.85% step time on Moonlight 16B).

:class:`megatron_bridge_ext.levers.recompute.probe.RecomputeProbe` shows at run time that the flag took effect;
:mod:`.config` lists the modules Megatron Core accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNFUSED = "unfused"
FUSED = "fused"


@dataclass(frozen=True)
class AttentionKind:
    """Which attention implementation a model uses, and what that means for ``core_attn`` recompute."""

    kind: str
    implementation: str

    @property
    def materialises_scores(self) -> bool:
        return self.kind == UNFUSED

    def core_attn_effect(self) -> str:
        if self.materialises_scores:
            return (f"{self.implementation} materialises the s x s softmax output per layer; core_attn recompute "
                    "drops it (and the dropout mask/output) at the cost of recomputing attention in backward")
        return (f"{self.implementation} keeps no s x s matrix: core_attn recompute costs time for little or "
                "no memory; prefer other recompute modules or a LoRA input strategy")


def attention_kind(model: torch.nn.Module) -> AttentionKind:
    """The attention implementation of a built model, from its core-attention modules."""
    names = {type(m).__name__ for n, m in model.named_modules() if n.endswith("core_attention")}
    if not names:
        raise ValueError("no core_attention module found: is this a Megatron Core transformer?")
    implementation = ", ".join(sorted(names))
    te_names = {n for n in names if n.startswith("TE")}
    if te_names and not _te_unfused_backend():
        return AttentionKind(FUSED, implementation)
    return AttentionKind(UNFUSED, implementation)


def attention_kind_from_config(config) -> AttentionKind:
    """The attention implementation a Bridge model provider/TransformerConfig will build, before building it.

    The one rule for every place that decides it before a model exists (``MemoryConfig.validate``,
    the estimate behind ``mbx plan``). The layer spec decides: Megatron Core's local spec builds
    ``DotProductAttention`` (unfused); the TE spec builds ``TEDotProductAttention``, fused unless
    ``attention_backend`` is ``local``/``unfused`` (Bridge then swaps in Core's unfused attention) or
    this machine's environment turns TE's flash and fused backends off. Bridge's ``default_layer_spec``
    is the TE spec whether or not TE is installed (without TE it cannot be built at all), so a recipe
    that keeps it is judged as the TE model it describes, on every machine. A recipe's own spec function is
    built and its core attention read (Gemma 3's subclass of TE's attention is TE's where TE is a stub; Gemma 2's
    torch FlexAttention keeps no s x s matrix either, :mod:`~megatron_bridge_ext.estimate.features.flex_attention`),
    and a provider that builds its own spec whatever ``transformer_layer_spec`` says is judged by that spec
    (:func:`megatron_bridge_ext.estimate.features.recipe_attention.built_spec`).
    """
    from megatron_bridge_ext.estimate.features import flex_attention, recipe_attention

    backend = str(getattr(config, "attention_backend", "auto")).rsplit(".", 1)[-1].lower()
    spec_name, uses_te = _spec_uses_te(recipe_attention.built_spec(config))
    where = f"(attention_backend={backend}, spec={spec_name})"
    if backend not in ("local", UNFUSED) and flex_attention.used(config):
        return AttentionKind(FUSED, f"torch FlexAttention {where}")
    if backend in ("local", UNFUSED) or not uses_te:
        return AttentionKind(UNFUSED, f"unfused attention {where}")
    if _te_unfused_backend():
        return AttentionKind(UNFUSED, f"TE's unfused attention {where[:-1]}, NVTE_FLASH_ATTN=0, NVTE_FUSED_ATTN=0)")
    return AttentionKind(FUSED, f"TE attention {where}")


def _spec_uses_te(spec) -> tuple[str, bool]:
    """The spec's name and whether its core attention is Transformer Engine's.

    None or Bridge's ``default_layer_spec``: TE's spec. A built ``ModuleSpec``: its core-attention
    class (TE's: :func:`~megatron_bridge_ext.estimate.features.recipe_attention.is_te_class`). A spec function
    that cannot be built here: its name (``..._transformer_engine_...``, ``te_...``), or its module where Core
    builds that module's specs on TE only (:data:`TE_ONLY_SPEC_MODULES`).
    """
    from megatron_bridge_ext.estimate.features.recipe_attention import declared_name, is_te_class

    if spec is None:
        return "default", True
    core = getattr(getattr(getattr(getattr(spec, "submodules", None), "self_attention", None), "submodules", None),
                   "core_attention", None)
    if core is not None:
        name = declared_name(core) or getattr(core, "__name__", type(core).__name__)
        return f"ModuleSpec with {name}", is_te_class(core)
    name = getattr(spec, "__name__", repr(spec))
    lowered = name.lower()
    te_only = getattr(spec, "__module__", None) in TE_ONLY_SPEC_MODULES
    return name, te_only or name == "default_layer_spec" or "te" in lowered.split("_") or "transformer_engine" in lowered


TE_ONLY_SPEC_MODULES = ("megatron.core.models.gpt.experimental_attention_variant_module_specs",)
"""Megatron Core's spec modules whose functions build on Transformer Engine only: the experimental attention variants'
(DeepSeek sparse attention, gated delta net; GLM-5.2's ``get_transformer_block_with_experimental_attention_variant_spec``)
take their backend from ``_get_backend_spec_provider``, which asserts ``transformer_impl == 'transformer_engine'`` and
returns ``TESpecProvider`` (``experimental_attention_variant_module_specs.py`` L439-452): its layers' attention is TE's
fused one, whatever their names say."""


def _te_unfused_backend() -> bool:
    import os

    return os.environ.get("NVTE_FLASH_ATTN") == "0" and os.environ.get("NVTE_FUSED_ATTN") == "0"


def core_attn_bytes_per_layer(*, seq: int, micro_batch: int, heads: int, tp: int, element_size: int,
                              attention_dropout: float = 0.0, dropout_mask_element_size: int = 1) -> int:
    """Bytes of the s x s tensors unfused attention keeps per layer on one TP rank.

    The softmax output [b, a/t, s, s]; with dropout also its mask and output. CUDA's fused dropout
    keeps a 1-byte mask (the default): with 16-bit elements this is Korthikanti et al.'s
    5*a*s^2*b / t. torch's CPU dropout multiplies by a mask of the input's dtype
    (``dropout_mask_element_size=element_size``).
    """
    elements = micro_batch * (heads // tp) * seq * seq
    with_dropout = elements * (dropout_mask_element_size + element_size) if attention_dropout > 0 else 0
    return elements * element_size + with_dropout
