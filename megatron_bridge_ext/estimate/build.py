"""The model one rank of a Bridge config builds: the config's own provider, on fake tensors.

Bridge's ``provider.provide()`` runs under ``FakeTensorMode`` inside :func:`..fake.fake_parallel_world`,
so the GPTModel has this rank's real parameter shapes (TP shards, this pipeline stage's layers,
its embedding or output layer) and costs no memory. The config's PEFT object then transforms it
outside the fake mode (adapters call ``.to(dtype)`` on real modules, which a fake module refuses;
adapters are small), and every parameter is swapped for a fake one on the traced device in the
model's training dtype, as Megatron's ``Float16Module`` casts the whole model.

The layer spec is Megatron Core's local one (Transformer Engine cannot run here), with a fused
attention stand-in unless the local unfused attention is asked for, and a recipe's own attention modules where the
run uses them (:mod:`.features.recipe_attention`); what Transformer Engine's fused norm-linear keeps differently is
added by :mod:`.te`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from megatron_bridge_ext.estimate.features import (dsa, gated_delta_net, latent_moe, mla, moe_act, mtp,
                                                   recipe_attention)
from megatron_bridge_ext.estimate.mamba import mamba_kernels, rebind_parameters

FUSED = "fused"
LOCAL = "local"
ATTENTIONS = (FUSED, LOCAL)


def moe_layer_pattern(provider) -> list[int]:
    """1 for each MoE layer of the model, 0 for each dense one, as Megatron Core reads ``moe_layer_freq``
    (``gpt_layer_specs.get_gpt_decoder_layer_specs``: an int N makes every N-th layer MoE, from the first; a
    list marks each layer); every layer dense without experts."""
    if not getattr(provider, "num_moe_experts", None):
        return [0] * provider.num_layers
    freq = getattr(provider, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(provider.num_layers)]
    return [int(moe) for moe in freq]


def layer_kinds(provider) -> list:
    """The kind of each layer: a hybrid model's pattern symbols (``M``, ``*``, ``-``, ``E``), a gated-delta-net
    model's (MoE, linear attention) pairs (:func:`gpt_layer_kinds`), otherwise :func:`moe_layer_pattern`'s 1 (MoE)
    or 0 (dense)."""
    from megatron_bridge_ext.estimate.unmodelled import hybrid_pattern

    pattern = hybrid_pattern(provider)
    return list(pattern) if pattern is not None else gpt_layer_kinds(provider)


def gpt_layer_kinds(config) -> list:
    """A GPT model's layer kinds, from a provider or Core's config: :func:`moe_layer_pattern`, paired with
    :func:`..features.gated_delta_net.attention_pattern` (1: gated delta net, 0: full attention) where the model has
    gated-delta-net layers, as Core's experimental spec reads the two patterns apart
    (``get_transformer_layer_with_experimental_attention_variant_spec``)."""
    moe = moe_layer_pattern(config)
    if gated_delta_net.used(config):
        return list(zip(moe, gated_delta_net.attention_pattern(config)))
    return moe


def is_moe_kind(kind) -> bool:
    """Whether a layer of ``kind`` (:func:`layer_kinds`) has experts."""
    from megatron_bridge_ext.estimate.unmodelled import MOE

    return (kind[0] if isinstance(kind, tuple) else kind) in (1, MOE)


def set_gpt_layer_kinds(provider, kinds: list) -> None:
    """Core's fields that make a GPT model's layers of ``kinds`` (:func:`gpt_layer_kinds`), one per layer."""
    if gated_delta_net.used(provider):
        provider.linear_attention_freq = [linear for _, linear in kinds]
        kinds = [moe for moe, _ in kinds]
    if getattr(provider, "num_moe_experts", None):
        provider.moe_layer_freq = list(kinds)


def stage_layer_kinds(provider, stage: int) -> list:
    """The kinds of pipeline stage ``stage``'s layers: a hybrid model's segment of its pattern
    (:func:`..unmodelled.pipeline_segments`), a GPT model's layers as Core splits them
    (:func:`..pipeline.stage_layers`: chunk after chunk under an interleaved split)."""
    from megatron_bridge_ext.estimate.pipeline import stage_layers
    from megatron_bridge_ext.estimate.unmodelled import pipeline_segments

    segments = pipeline_segments(provider)
    if segments is not None:
        return list(segments[stage])
    kinds = layer_kinds(provider)
    return [kinds[layer] for layer in stage_layers(provider, stage)]


def set_layer_kinds(provider, kinds: list) -> None:
    """Make ``provider`` (a copy) build layers of ``kinds`` (as :func:`layer_kinds` gives them), one stage's worth
    repeated over its pipeline stages in an even split without interleaving (a hybrid model's as segments between
    ``|`` marks, its multi-token prediction depths' patterns after ``/`` kept); the embedding stays on the first stage
    and the loss on the last."""
    from megatron_bridge_ext.estimate.unmodelled import MTP_SEPARATOR

    pp = provider.pipeline_model_parallel_size
    provider.num_layers = len(kinds) * pp
    provider.pipeline_model_parallel_layout = provider.virtual_pipeline_model_parallel_size = None
    provider.account_for_embedding_in_pipeline_split = provider.account_for_loss_in_pipeline_split = False
    provider.num_layers_in_first_pipeline_stage = provider.num_layers_in_last_pipeline_stage = None
    if is_hybrid(provider):
        given = provider.hybrid_layer_pattern or provider.hybrid_override_pattern
        depths = given[len(given.split(MTP_SEPARATOR, 1)[0]):]
        provider.hybrid_layer_pattern = "|".join(["".join(kinds)] * pp) + depths
        provider.hybrid_override_pattern = None
    else:
        set_gpt_layer_kinds(provider, list(kinds) * pp)


def layer_spec(provider, attention: str, *, transformer_impl: str):
    """Megatron Core's local GPT layer spec for ``provider``'s norms, attention and experts, with the attention kind
    asked for.

    With experts it is Core's local MoE spec: the router, the config's token dispatcher and SequentialMLP
    experts (the local backend has no grouped GEMM, whatever ``moe_grouped_gemm`` asks; the estimate
    says so in its assumptions). With dense and MoE layers mixed (``moe_layer_freq``), a block spec of the
    two in the model's pattern, as Core's ``get_gpt_decoder_block_spec`` makes it on the local backend.
    With multi-latent attention, Core's ``MLASelfAttention``, in Transformer Engine's layout of its projections
    when ``transformer_impl`` is ``transformer_engine`` (:func:`..features.mla.te_layout`); with DeepSeek sparse
    attention, Core's DSA spec (:func:`..features.dsa.attention_spec`).
    With gated-delta-net layers, a block spec in the model's pattern whose linear layers' attention is Core's
    ``GatedDeltaNet`` (:func:`..features.gated_delta_net.gdn_attention_spec`).
    """
    pattern = gpt_layer_kinds(provider)
    te = transformer_impl == mla.TRANSFORMER_ENGINE
    if len(set(pattern)) > 1 or gated_delta_net.used(provider):
        return _mixed_block_spec(provider, attention, te=te)
    return _local_layer_spec(provider, attention, moe=1 in pattern, te=te)


def _local_layer_spec(provider, attention: str, *, moe: bool, te: bool = False, latent: bool = True):
    """``latent``: build multi-latent attention where the model has it (a hybrid stack's attention layers do not)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    experts = provider.num_moe_experts if moe else None
    latent = latent and mla.used(provider)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=bool(getattr(provider, "moe_grouped_gemm",
                                                                                        False)) if experts else False,
                                    qk_layernorm=bool(provider.qk_layernorm), normalization=provider.normalization,
                                    multi_latent_attention=latent)
    own_core = recipe_attention.own_core_attention(provider, fused=attention == FUSED)
    if own_core is not None:
        spec.submodules.self_attention.submodules.core_attention = own_core
    elif attention == FUSED:
        from megatron_bridge_ext.estimate.standins import FusedAttentionStandIn

        spec.submodules.self_attention.submodules.core_attention = FusedAttentionStandIn
    elif recipe_attention.interleaved_windows(provider):
        spec.submodules.self_attention.submodules.core_attention = recipe_attention.layer_window_attention()
    if latent and dsa.used(provider):
        spec.submodules.self_attention = dsa.attention_spec(provider)
    elif latent and te:
        mla.te_layout(spec.submodules.self_attention)
    own = None if latent else recipe_attention.self_attention_module(provider)
    if own is not None:
        spec.submodules.self_attention.module = own
    return spec


def _mixed_block_spec(provider, attention: str, *, te: bool):
    """The decoder block spec of a model whose layers differ (dense and MoE, gated delta net and full attention): a
    callable of the config, as Bridge's provider takes its ``transformer_layer_spec``, that builds this stage's slice
    of the pattern (Core's layer offset and layer count, the final norm of a single-layer spec)."""
    specs = {kind: _kind_spec(provider, attention, kind, te=te) for kind in dict.fromkeys(gpt_layer_kinds(provider))}

    def block_spec(config, vp_stage=None):
        from megatron.core.transformer.transformer_block import (LayerNormImpl, TransformerBlockSubmodules,
                                                                 get_num_layers_to_build)
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        pattern = gpt_layer_kinds(config)[offset:offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
        return TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in pattern], layer_norm=LayerNormImpl)

    return block_spec


def _kind_spec(provider, attention: str, kind, *, te: bool):
    """The local layer spec of one :func:`gpt_layer_kinds` kind; a gated-delta-net layer's attention is Core's
    ``GatedDeltaNet``, its input norm the local spec's standalone norm before ``in_proj``."""
    moe, linear = kind if isinstance(kind, tuple) else (kind, 0)
    spec = _local_layer_spec(provider, attention, moe=bool(moe), te=te)
    if linear:
        spec.submodules.self_attention = gated_delta_net.gdn_attention_spec(provider)
    return spec


def is_hybrid(provider) -> bool:
    """A hybrid (Mamba) model: Bridge's ``HybridModelProvider`` with a layer pattern."""
    from megatron_bridge_ext.estimate.unmodelled import hybrid_pattern

    return hybrid_pattern(provider) is not None


def hybrid_stack_spec(provider, attention: str):
    """Megatron Core's hybrid stack on the local backend, layer for layer as its TE spec
    (``models/hybrid/hybrid_layer_specs.py``, ``hybrid_stack_spec``) builds it: a Mamba layer is its norm,
    ``MambaMixer`` (``in_proj`` column-parallel, ``out_proj`` row-parallel) and the residual; an attention layer
    is the local GPT layer's norm and self-attention; an MLP layer (``MLPLayer``) and an MoE layer
    (``MoETransformerLayer``) are its pre-MLP norm and MLP or MoE. Where the TE spec fuses a norm into the
    following linear (``TELayerNormColumnParallelLinear``) the local one runs them apart, as for GPT models
    (what TE keeps differently is added by :mod:`.te`). The Mamba kernels are stand-ins (:mod:`.mamba`). With
    multi-token prediction, its block's norms and projection of the local backend
    (:func:`..features.mtp.local_hybrid_block_spec`); each depth's layers are this stack's, by the MTP pattern."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)

    dense = _local_layer_spec(provider, attention, moe=False, latent=False).submodules
    norm = dense.input_layernorm
    mixer = ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                                          out_proj=RowParallelLinear))
    layers = dict(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(norm=norm, mixer=mixer,
                                                                                  mamba_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=dense.self_attention, self_attn_bda=dense.self_attn_bda)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=dense.mlp, mlp_bda=dense.mlp_bda)))
    if getattr(provider, "num_moe_experts", None):
        moe = _local_layer_spec(provider, attention, moe=True, latent=False).submodules
        layers["moe_layer"] = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=moe.mlp, mlp_bda=moe.mlp_bda))
    if mtp.used(provider):
        layers["mtp_block_spec"] = mtp.local_hybrid_block_spec(norm)
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(**layers))


def mtp_layer_spec(provider, attention: str, *, transformer_impl: str, moe: Optional[bool] = None):
    """The transformer layer of each multi-token prediction depth: the decoder's last layer's spec, as Core takes it
    (``gpt_layer_specs.py`` L767-771); ``moe``: whether that layer is an MoE layer (default: the last of
    ``provider``'s :func:`moe_layer_pattern`; a stage traced with fewer layers passes the real model's)."""
    moe = moe_layer_pattern(provider)[-1] == 1 if moe is None else moe
    return _local_layer_spec(provider, attention, moe=moe, te=transformer_impl == mla.TRANSFORMER_ENGINE)


def build_rank_model(provider, peft, *, attention: str, mode: FakeTensorMode, device: str,
                     dtype: torch.dtype, transformer_impl: str, mtp_moe: Optional[bool] = None) -> torch.nn.Module:
    """This rank's GPTModel in training mode, with ``peft`` applied, every parameter fake on ``device``.

    ``provider`` is a finalized copy the caller owns (it is changed: spec, initialisation flags).
    ``transformer_impl``: ``transformer_engine`` builds multi-latent attention in TE's layout (:func:`layer_spec`).
    ``mtp_moe``: whether multi-token prediction's layers are MoE layers (:func:`mtp_layer_spec`).
    Must run inside :func:`..fake.fake_parallel_world`.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnBackend

    hybrid = is_hybrid(provider)
    gdn = gated_delta_net.used(provider)
    latent_te = mla.used(provider) and transformer_impl == mla.TRANSFORMER_ENGINE
    if hybrid:
        provider.hybrid_stack_spec = hybrid_stack_spec(provider, attention)
    else:
        provider.transformer_layer_spec = layer_spec(provider, attention, transformer_impl=transformer_impl)
    provider.attention_backend = AttnBackend.auto  # the spec chooses the attention; "local" would replace the stand-in
    provider.use_cpu_initialization = True
    provider.perform_initialization = False
    provider.gradient_accumulation_fusion = False
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    mtp_block = (mtp.local_modules(mtp_layer_spec(provider, attention, transformer_impl=transformer_impl,
                                                  moe=mtp_moe))
                 if mtp.used(provider) and not hybrid else contextlib.nullcontext())
    with mode, (mamba_kernels() if hybrid else contextlib.nullcontext()), \
            (mla.te_modules() if latent_te else contextlib.nullcontext()), mtp_block, \
            latent_moe.te_modules(provider), moe_act.te_grouped_recompute(provider), \
            (dsa.te_modules() if dsa.used(provider) else contextlib.nullcontext()), \
            (gated_delta_net.kernels() if gdn else contextlib.nullcontext()):
        model = provider.provide()
    if peft is not None:
        model = _apply_peft(model, copy.deepcopy(peft), latent_te=latent_te)
    _to_fake_device(model, mode, device, dtype)
    if hybrid:
        rebind_parameters(model)
    return model.train()


def _apply_peft(model, peft, *, latent_te: bool):
    """``peft(model)`` as training does, with its per-adapter log lines held back (a trace is not a run), and what it
    prints too: under recompute with only adapters trainable Bridge patches the recompute block and says so with
    ``print_rank_0`` (``peft/base.py`` L119-120, ``peft/recompute.py`` L113-118), once per traced candidate.

    The adapters are created on the CPU (``use_cpu_initialization``), so Megatron's collectives that
    allocate on ``torch.cuda.current_device()`` while they are built (DoRA gathers the adapter weights
    over TP for its magnitude's initial norm) allocate there too: same shapes, no GPU needed, and no
    CPU/GPU mix where a GPU is present. ``latent_te``: multi-latent attention in Transformer Engine's layout, whose
    stand-ins Bridge takes for TE's modules (:func:`.features.mla.bridge_lora_view`).
    """
    from megatron_bridge_ext.estimate.fake import current_device, scoped_patch
    from megatron_bridge_ext.patches import bridge_truthful_te_detection

    with scoped_patch(bridge_truthful_te_detection.PATCH), current_device("cpu"), _adapter_values_left_unset(), \
            (mla.bridge_lora_view() if latent_te else contextlib.nullcontext()), \
            _quiet("megatron.bridge", "megatron_bridge_ext.peft"), contextlib.redirect_stdout(io.StringIO()):
        out = peft(model, training=True)
    return out[0] if isinstance(out, list) else out


@contextlib.contextmanager
def _adapter_values_left_unset():
    """Adapters allocated, their initial values not computed: the trace reads shapes only.

    Bridge forces ``perform_initialization`` on for its adapters, and Megatron Core's CPU path
    (``_initialize_affine_weight_cpu`` in ``tensor_parallel/layers.py``) then builds each adapter's whole
    master weight, fills it, splits it over TP and copies this rank's part: seconds per hundred adapters,
    minutes for an MoE model's thousands of expert adapters. In its place only the tensor-parallel
    attributes are set, as Core's function sets them; the weights keep ``torch.empty``'s values.
    """
    from megatron.core.tensor_parallel import layers

    def attributes_only(weight, output_size, input_size, per_partition_size, partition_dim, init_method, stride=1,
                        return_master_weight=False, *, skip_set_tensor_parallel_attributes=False, **kwargs):
        if not skip_set_tensor_parallel_attributes:
            layers.set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim,
                                                        stride=stride)
        return None

    saved = layers._initialize_affine_weight_cpu
    layers._initialize_affine_weight_cpu = attributes_only
    try:
        yield
    finally:
        layers._initialize_affine_weight_cpu = saved


@contextlib.contextmanager
def _quiet(*names: str):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _fake_parameter(param: torch.nn.Parameter, device: str, dtype: torch.dtype) -> torch.nn.Parameter:
    """A fake parameter (inside a FakeTensorMode) of ``param``'s shape and strides on ``device``, floating ones in
    ``dtype``, with ``param``'s attributes."""
    target = dtype if param.is_floating_point() else param.dtype
    if isinstance(param, FakeTensor):
        fake = param.detach().to(device=device, dtype=target)
    else:
        fake = torch.empty_strided(param.shape, param.stride(), dtype=target, device=device)
    new = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
    new.__dict__.update({k: v for k, v in param.__dict__.items() if k not in new.__dict__})
    return new


def _to_fake_device(model: torch.nn.Module, mode: FakeTensorMode, device: str, dtype: torch.dtype) -> None:
    """Every parameter and buffer becomes a fake tensor on ``device``; floating parameters take ``dtype``.

    The Parameter objects are replaced, keeping Megatron's attributes on them (``tensor_model_parallel``,
    ``sequence_parallel``, ...) and ``requires_grad``, but not the fake tensor's own attributes; a parameter two
    modules hold (tied weights) stays one. A parameter's values are never read, so its fake is made empty with its
    shape and strides (a quarter of the time of converting the tensor).
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad(), mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in replaced:
                    replaced[id(param)] = _fake_parameter(param, device, dtype)
                module._parameters[name] = replaced[id(param)]
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    fake = buffer if isinstance(buffer, FakeTensor) else mode.from_tensor(buffer)
                    module._buffers[name] = fake.to(device)
