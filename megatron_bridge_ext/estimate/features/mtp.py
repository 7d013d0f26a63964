"""Multi-token prediction (DeepSeek-V3, GLM-4.5, Qwen3-Next, Nemotron 3 Super): Megatron Core's MTP block, traced.

Core's ``MultiTokenPredictionBlock`` (``transformer/multi_token_prediction.py``) sits on the last pipeline stage
(``mtp_on_this_rank``, L616-659, without a custom pipeline layout) and runs ``mtp_num_layers`` depths after the
decoder (``gpt_model.py`` L666-680). Each depth (``MultiTokenPredictionLayer``, L897-1227) embeds the input ids
rolled one further left with the model's own embedding (L1064-1126; so the last stage holds a copy of the word
embedding, L167), norms that embedding (``enorm``) and the previous depth's hidden state (``hnorm``), projects their
[s, b, 2h] concatenation back to h (``eh_proj``, a column-parallel linear, its output gathered over TP and scattered
back over the sequence under sequence parallelism, L1128-1153: the scatter's slice of the gathered tensor is a view,
``mappings.py`` L79, which the depth's first norm keeps alive whole), runs one transformer layer of the decoder's
last layer's spec (``get_gpt_mtp_block_spec_for_backend``, ``gpt_layer_specs.py`` L767-777; a hybrid model's depth
runs the layers of its MTP pattern, ``hybrid_model.py`` L287-305) and a final norm (L1227-1239). Then
``process_mtp_loss`` (L760-894) runs the output layer on each depth's hidden state: a full-vocabulary logits tensor
and a cross-entropy per depth, whose loss (scaled by ``mtp_loss_scaling_factor / mtp_num_layers``, L875) reaches
backward through ``MTPLossAutoScaler`` (L714-757, which keeps the scaled per-token loss).

The estimate runs that code on fake tensors, with the decoder: what the depths save counts as
:data:`..trace.MTP` (the MTP block's modules), their logits and losses as logits and loss (the model's output layer
and its own forward). Bridge asks for Transformer Engine's MTP layer (``gpt_provider.py`` L343-376,
``use_transformer_engine=True``: ``TENorm`` and ``TEColumnParallelLinear``), which cannot run here; the local
backend's (Core's norms and ``ColumnParallelLinear``, ``get_mtp_layer_spec_for_backend`` L593-613) stands in around
the same transformer layer spec as the decoder's (:func:`local_block_spec`). Their saves are the same: a norm keeps
its input and statistics, a linear without FP8 its input (the sequence shard under sequence parallelism, gathered
again in backward), as for the decoder's linears (:mod:`..te`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from megatron_bridge_ext.findings import ERROR, Finding


def used(model) -> bool:
    return bool(getattr(model, "mtp_num_layers", None))


def findings(model) -> list[Finding]:
    """The variants of multi-token prediction the estimate does not model, one finding each."""
    if not used(model):
        return []
    out = []
    if _standalone(model):
        out.append(_not_modelled("model.pipeline_model_parallel_layout",
                                 "multi-token prediction on a pipeline stage before the loss's (Core's standalone "
                                 "MTP, whose stage hands the decoder's and every depth's hidden states on) is not "
                                 "modelled by the estimate", "put the layout's 'm' on the last stage, before its 'L'"))
    if getattr(model, "fp8", None):
        out.append(_not_modelled("model.mtp_num_layers",
                                 "FP8 in multi-token prediction's layers is not modelled by the estimate (their "
                                 "quantised weights and inputs are not counted)", "estimate the bf16 config"))
    return out


def _standalone(model) -> bool:
    """Whether a custom pipeline layout puts the MTP depths on a stage before the last (Core's ``mtp_standalone``,
    ``pipeline_parallel_layer_layout.py`` L136-145)."""
    from megatron_bridge_ext.estimate.pipeline import parse_layout

    layout = getattr(model, "pipeline_model_parallel_layout", None)
    stages = parse_layout(layout, model.pipeline_model_parallel_size) if layout is not None else None
    return bool(stages) and any("mtp" in chunk for stage in stages[:-1] for chunk in stage)


def _not_modelled(setting: str, message: str, fix: str) -> Finding:
    return Finding("unsupported_model", ERROR, setting, message, fix)


def local_block_spec(layer_spec):
    """Bridge's ``mtp_block_spec(config, vp_stage)`` (``gpt_provider.py`` L343-376) on Core's local backend: the MTP
    block of ``mtp_num_layers`` depths around ``layer_spec`` (the spec of the decoder's last layer), None without
    MTP or off the stage that holds it (``get_gpt_mtp_block_spec_for_backend`` L763-765)."""

    def block_spec(config, vp_stage: Optional[int] = None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        if not used(config):
            return None
        return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage)

    return block_spec


def local_hybrid_block_spec(norm):
    """The MTP block of a hybrid model on Core's local backend: Core's ``_hybrid_mtp_block_spec``
    (``models/hybrid/hybrid_layer_specs.py`` L71-86: ``TENorm`` norms and a ``TEColumnParallelLinear`` eh_proj, the
    depth's layers built by ``HybridModel`` from the MTP pattern with the stack's own layer specs,
    ``hybrid_model.py`` L287-305) with ``norm`` (the local stack's norm) and Core's ``ColumnParallelLinear``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlock,
                                                                  MultiTokenPredictionBlockSubmodules,
                                                                  MultiTokenPredictionLayer,
                                                                  MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=norm))
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]))


@contextlib.contextmanager
def local_modules(layer_spec) -> Iterator[None]:
    """While the model is built: Bridge's GPT provider takes :func:`local_block_spec` for its MTP block. Put back on
    exit."""
    from megatron.bridge.models import gpt_provider

    saved = gpt_provider.mtp_block_spec
    gpt_provider.mtp_block_spec = local_block_spec(layer_spec)
    try:
        yield
    finally:
        gpt_provider.mtp_block_spec = saved


@contextlib.contextmanager
def final_norm_on_stage(holds: bool) -> Iterator[None]:
    """While a stage is built as one chunk of its layers (or a few of them): the decoder's final norm is built on it
    iff the real stage holds the last decoder layer, where Core builds it under multi-token prediction
    (``transformer_block.py`` ``has_final_layernorm_in_this_stage`` L387-413, by the layer's global number, which
    the stage's build renumbers). Put back on exit."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    saved = TransformerBlock.has_final_layernorm_in_this_stage

    def has_final_layernorm_in_this_stage(block):
        return block.submodules.layer_norm and holds and block.post_layer_norm

    TransformerBlock.has_final_layernorm_in_this_stage = has_final_layernorm_in_this_stage
    try:
        yield
    finally:
        TransformerBlock.has_final_layernorm_in_this_stage = saved


def assumption(model) -> Optional[str]:
    """How the estimate traced the model's multi-token prediction, or None without it."""
    if not used(model):
        return None
    return (f"multi-token prediction: Megatron Core's MTP block traced on the last pipeline stage (in its last "
            "model chunk, where Core builds it with or without a custom layout), "
            f"{model.mtp_num_layers} depth(s) of norms, eh_proj over [s, b, 2h] and one transformer layer of the "
            "decoder's last layer's spec (Core's local norms and column-parallel eh_proj in place of Transformer "
            "Engine's, which keep the same), then each depth's full-vocabulary logits and loss "
            f"(scaled by mtp_loss_scaling_factor / mtp_num_layers = {model.mtp_loss_scaling_factor} / "
            f"{model.mtp_num_layers}, which changes no memory) (estimate.features.mtp)")
