"""Megatron Core's experimental attention variants (``experimental_attention_variant``) on models without multi-latent
attention: Qwen3-Next's and Qwen3.5's gated delta net (linear attention on three of every four layers, Core's
``ssm/gated_delta_net``, built by ``get_transformer_block_with_experimental_attention_variant_spec``).

The estimate traces its own layer spec, whose attention is Core's ``SelfAttention``: a variant layer traced so would
be counted as softmax attention, which keeps other tensors (the delta rule's chunked state, not [s, s] scores). The
gated delta net is modelled (:mod:`.gated_delta_net`: Core's ``GatedDeltaNet`` on its linear layers); any other
variant is refused by name; multi-latent attention's variants are :mod:`.mla`'s.
"""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding

MODELLED: tuple[str, ...] = ("gated_delta_net",)
"""The variants the estimate traces on models without multi-latent attention."""


def findings(model) -> list[Finding]:
    variant = getattr(model, "experimental_attention_variant", None)
    if not variant or variant in MODELLED or getattr(model, "multi_latent_attention", False):
        return []
    return [Finding("unsupported_model", ERROR, "model.experimental_attention_variant",
                    f"the {variant!r} attention variant (Core's experimental attention spec) is not modelled by the "
                    "estimate: its layers would be traced as softmax attention, which keeps other tensors",
                    "read Bridge's figure beside it, or measure one training step on a GPU")]
