"""A recipe's own attention modules, kept in the traced local spec, and the attention its run uses.

The estimate traces Megatron Core's local layer spec in place of the recipe's (:mod:`..build`). Where the recipe's
spec builds a subclass of Core's ``SelfAttention`` that changes what reaches attention, that subclass is kept:
Gemma 3's ``Gemma3SelfAttention`` (Bridge ``models/gemma/gemma3_provider.py`` L173-224) takes the model's stacked
local and global rotary embeddings ([2, s, 1, 1, d], ``Gemma3RotaryEmbedding``, L285-346) and hands each layer the
one of its kind (``_is_local_attn_layer``, L349-354); Core's ``SelfAttention`` given both would apply a 5-D rotary
embedding to 4-D queries. The subclass's projections and core attention are the local spec's.

Which attention a run uses is read from the layer spec the model is built with (:func:`built_spec`), and the core
attention of that spec decides (:func:`is_te_class`). Gemma 3's is ``Gemma3TEDotProductAttention``, a subclass of
Core's ``TEDotProductAttention`` (L225-269): where Transformer Engine does not import, Core puts a ``MagicMock`` in
place of ``te`` (``extensions/transformer_engine.py`` L74-85), so ``TEDotProductAttention`` and every class declared on
it is a mock whose class body is kept as its return value; such a class is Transformer Engine's. Gemma 4's dense
provider builds its own spec whatever ``transformer_layer_spec`` says (``Gemma4DenseProvider.build``,
``gemma4_provider.py`` L207-263: ``get_gemma4_layer_spec``, Core's local ``DotProductAttention``, ``modeling_gemma4.py``
L744-776), so its run, and its trace, use Core's unfused attention.
"""

from __future__ import annotations

from typing import Optional
from unittest import mock

from megatron_bridge_ext.findings import ERROR, Finding

OWN_SPECS = {"Gemma4DenseProvider": ("megatron.bridge.models.gemma.modeling_gemma4", "get_gemma4_layer_spec")}
"""Providers whose ``provide`` builds the model with a spec of their own, ignoring ``transformer_layer_spec``: the
class name -> the module and function of that spec."""


def own_spec_function(provider):
    """The spec function the provider builds its model with whatever its ``transformer_layer_spec``, or None."""
    import importlib

    for cls in type(provider).__mro__:
        if cls.__name__ in OWN_SPECS:
            module, function = OWN_SPECS[cls.__name__]
            return getattr(importlib.import_module(module), function)
    return None


def built_spec(provider):
    """The layer spec the provider's model is built with, as a ``ModuleSpec`` where it can be built here
    (:func:`own_spec_function`, else :func:`recipe_spec`); else the provider's ``transformer_layer_spec`` as it is."""
    own = own_spec_function(provider)
    if own is not None:
        return own(provider)
    return recipe_spec(provider) or getattr(provider, "transformer_layer_spec", None)


def declared_name(cls) -> Optional[str]:
    """A class's name: a real class's, or the name in the class body of one declared on Core's ``MagicMock`` in place
    of Transformer Engine (the mock's return value is that body); None for anything else."""
    if isinstance(cls, type):
        return cls.__name__
    body = cls.__dict__.get("_mock_return_value") if isinstance(cls, mock.NonCallableMock) else None
    return body.get("__qualname__") if isinstance(body, dict) else None


def is_te_class(cls) -> bool:
    """Transformer Engine's: a subclass of Core's ``TEDotProductAttention`` where TE imports, a class declared on Core's
    mock of TE where it does not (:func:`declared_name`), or a class named ``TE...``."""
    if isinstance(cls, mock.NonCallableMock):
        return declared_name(cls) is not None
    from megatron.core.extensions import transformer_engine

    te_attention = getattr(transformer_engine, "TEDotProductAttention", None)
    if isinstance(cls, type) and isinstance(te_attention, type) and issubclass(cls, te_attention):
        return True
    return isinstance(cls, type) and cls.__name__.startswith("TE")


def trace_findings(provider, *, attention: str, fused: str) -> list[Finding]:
    """A provider that builds its own local spec (:data:`OWN_SPECS`) cannot be traced with the fused stand-in."""
    own = own_spec_function(provider)
    if own is None or attention != fused:
        return []
    return [Finding("unsupported_model", ERROR, "attention",
                    f"fused attention is not modelled for {type(provider).__name__}: its provide() builds "
                    f"{own.__name__}'s layers, Core's unfused DotProductAttention, whatever the layer spec",
                    "estimate with --attention local (the default for this model)")]


def recipe_spec(provider):
    """The recipe's layer spec as a ``ModuleSpec`` (a spec function called with the config, as Bridge's provider
    calls it); None where it is Bridge's default or cannot be built here (it needs Transformer Engine)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = getattr(provider, "transformer_layer_spec", None)
    if spec is None or isinstance(spec, ModuleSpec):
        return spec
    if getattr(spec, "__name__", "") == "default_layer_spec":
        return None
    # Without TE a spec function fails in its own way (Core's experimental attention spec names TESpecProvider, which
    # it never imports: experimental_attention_variant_module_specs.py L453): any error means it cannot be built here.
    try:
        built = spec(provider)
    except Exception:  # noqa: BLE001
        return None
    return built if isinstance(built, ModuleSpec) else None


def spec_core_attention(provider):
    """The core attention of the recipe's spec (:func:`recipe_spec`), or None."""
    spec = recipe_spec(provider)
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    return getattr(getattr(attention, "submodules", None), "core_attention", None)


def own_core_attention(provider, *, fused: bool) -> Optional[type]:
    """The recipe's own core attention where the traced spec keeps it: a FlexAttention class (Gemma 2's,
    :mod:`.flex_attention`) under fused attention, its unfused parent under unfused; None elsewhere."""
    from megatron_bridge_ext.estimate.features import flex_attention

    core = spec_core_attention(provider)
    if not flex_attention.is_flex_class(core):
        return None
    return core if fused else flex_attention.unfused_class(core)


def packed_findings(provider, cfg) -> list[Finding]:
    """Gemma 2's core attentions raise on packed sequences (``gemma2_provider.py`` L186-190 and L375-378), which Bridge
    hands the model where the dataset packs them (``training/gpt_step.py`` L109-118, L440-451): such a run stops at its
    first forward, so it is refused, not estimated."""
    from megatron_bridge_ext.estimate.features import flex_attention

    core = spec_core_attention(provider)
    if not (isinstance(core, type) and core.__module__ in flex_attention.MODULES):
        return []
    from megatron.bridge.training.gpt_step import _uses_packed_sequence_metadata

    if not _uses_packed_sequence_metadata(cfg):
        return []
    setting = "enable_offline_packing" if getattr(cfg.dataset, "enable_offline_packing", False) \
        else "enable_in_batch_packing"
    return [Finding("unsupported_model", ERROR, f"dataset.{setting}",
                    f"{core.__name__} raises on packed sequences (gemma2_provider.py L186-190, L375-378), which "
                    "this dataset gives the model: the run stops at its first forward",
                    f"train on unpacked sequences, dataset.{setting}=false")]


def assumption(provider, *, fused: bool) -> Optional[str]:
    """What the estimate says of the attention it traced where it kept the recipe's own core attention, else None."""
    own = own_core_attention(provider, fused=fused)
    if own is None:
        return None
    if fused:
        return f"attention: the recipe's own {own.__name__} on torch FlexAttention (estimate.features.flex_attention)"
    return (f"attention: the recipe's own unfused {own.__name__} (keeps the [b, heads/t, s, s] probabilities), "
            "as its FlexAttention class runs with an attention mask or dropout")


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
