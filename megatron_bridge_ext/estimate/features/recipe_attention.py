"""A recipe's own self-attention module (Gemma 3's local and global RoPE), kept in the traced local spec.

The estimate traces Megatron Core's local layer spec in place of the recipe's (:mod:`..build`). Where the recipe's
spec builds a subclass of Core's ``SelfAttention`` that changes what reaches attention, that subclass is kept:
Gemma 3's ``Gemma3SelfAttention`` (Bridge ``models/gemma/gemma3_provider.py`` L173-224) takes the model's stacked
local and global rotary embeddings ([2, s, 1, 1, d], ``Gemma3RotaryEmbedding``, L285-346) and hands each layer the
one of its kind (``_is_local_attn_layer``, L349-354); Core's ``SelfAttention`` given both would apply a 5-D rotary
embedding to 4-D queries. The subclass's projections and core attention are the local spec's.
"""

from __future__ import annotations

from typing import Optional


def recipe_spec(provider):
    """The recipe's layer spec as a ``ModuleSpec`` (a spec function called with the config, as Bridge's provider
    calls it); None where it is Bridge's default or cannot be built here (it needs Transformer Engine)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = getattr(provider, "transformer_layer_spec", None)
    if spec is None or isinstance(spec, ModuleSpec):
        return spec
    if getattr(spec, "__name__", "") == "default_layer_spec":
        return None
    try:
        built = spec(provider)
    except (AssertionError, AttributeError, ImportError, NameError, RuntimeError, TypeError, ValueError):
        return None  # NameError: Core's spec functions name TE's classes, which are not defined without TE
    return built if isinstance(built, ModuleSpec) else None


def self_attention_module(provider) -> Optional[type]:
    """The recipe's self-attention class where it is a subclass of Core's ``SelfAttention``, else None."""
    from megatron.core.transformer.attention import SelfAttention

    spec = recipe_spec(provider)
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    module = getattr(attention, "module", None)
    if isinstance(module, type) and issubclass(module, SelfAttention) and module is not SelfAttention:
        return module
    return None


def interleaved_windows(provider) -> bool:
    """Gemma 3's convention: ``window_size`` one int for the local layers of ``interleaved_attn_pattern`` (local,
    global), which its core attention turns into each layer's window (``Gemma3TEDotProductAttention``, L245-262)."""
    return isinstance(getattr(provider, "window_size", None), int) and \
        getattr(provider, "interleaved_attn_pattern", None) is not None


def layer_window_attention():
    """Core's local ``DotProductAttention`` with each layer's window as Gemma 3's core attention sets it (L245-262:
    ``(window_size - 1, 0)`` on a local layer, none on a global one), for tracing Gemma 3's unfused attention; Core's
    softmax then builds the window's mask (``fused_softmax.py`` L321-322) or its causal kernel reads none."""
    import copy

    from megatron.bridge.models.gemma.gemma3_provider import _is_local_attn_layer
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LayerWindowDotProductAttention(DotProductAttention):
        def __init__(self, config, layer_number: int, *args, **kwargs):
            config = copy.deepcopy(config)
            local = _is_local_attn_layer(layer_number, config.interleaved_attn_pattern)
            config.window_size = (config.window_size - 1, 0) if local else None
            super().__init__(config, layer_number, *args, **kwargs)

    return LayerWindowDotProductAttention
