"""Multi-latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight): Megatron Core's ``MLASelfAttention``, traced.

Core's layer (``transformer/multi_latent_attention.py``) projects the layer input down and up: the query directly
(``linear_q_proj``, h -> heads x (qk_head_dim + qk_pos_emb_head_dim)) when ``q_lora_rank`` is None, else down to
``q_lora_rank`` (``linear_q_down_proj``), a norm, and up (``linear_q_up_proj``); keys and values down to
``kv_lora_rank + qk_pos_emb_head_dim`` (``linear_kv_down_proj``), the latent part normed and projected up to
heads x (qk_head_dim + v_head_dim) (``linear_kv_up_proj``), the positional part rotated and shared by every head
(``get_query_key_value_tensors``, L665-991). Core attention then takes keys of ``qk_head_dim + qk_pos_emb_head_dim`` and values of
``v_head_dim`` per head (:mod:`..standins`), and ``linear_proj`` maps heads x v_head_dim back to h. The estimate runs
that code on fake tensors; what it changes while tracing:

* The Transformer Engine spec (``gpt_layer_specs.py`` L295-318, what Bridge's providers build) gives the down
  projections TE's ``TELinear`` in ``duplicated`` mode (multi_latent_attention.py L525-526, L572-573: the whole
  weight on every TP rank, the sequence shard in, no communication), which cannot run here:
  :class:`DuplicatedLinear` stands in with its parameter and its saved set. Core's local spec (what the local
  backend builds) has column-parallel down projections instead, whose output Core gathers over TP and scatters
  back over the sequence (L650-654, L737-746): a different parameter count per rank and, under sequence
  parallelism, saves that keep the gathered latent alive (the scatter returns a slice of it, ``mappings.py`` L79).
* With ``qk_layernorm`` Core's resolver (``mla_qk_norm_config.py`` L132-168) fuses the query and key-value norms
  into the up projections (TE's ``TELayerNormColumnParallelLinear``): :class:`NormColumnParallelLinear` stands in,
  Core's local norm followed by its column-parallel linear, which keep what TE's fused module keeps
  (:mod:`..te`). Without ``q_lora_rank`` the resolver fuses a norm over the hidden size into ``linear_q_proj``
  (L147-150), which Core's local spec cannot build (L172-173 refuses its query norm).
* Core's local ``DotProductAttention`` takes no ``k_channels`` / ``v_channels`` (``dot_product_attention.py``
  L42-51, against L207-218 here): Core cannot build multi-latent attention on it, so only the fused attention
  stand-in is traced.
* ``recompute_modules`` with ``mla_up_proj`` (L171-174, L972-977, L454-457): the up projections and RoPE run inside
  Core's ``CheckpointWithoutOutput`` without grad, which keeps its inputs (the latents, the positional key part, the
  rotary frequencies; ``tensor_parallel/random.py`` L702-704); after core attention the query, key and value it
  made are released (their storages resized to nothing, L847-848) and recomputed in backward. The saved-tensor
  meter counts a storage released so by the end of the forward as nothing (``measure.saved``).
* LoRA on the latent projections: Bridge's LoRA takes the two stand-ins for TE's modules
  (:func:`bridge_lora_view`), so the adapters are the ones it builds on a GPU: on a duplicated down projection
  LoRA-A takes the sequence shard as it comes and LoRA-B's output is gathered over TP; a norm-fused projection
  returns its norm output (gathered under sequence parallelism) to LoRA-A and keeps its shard, as TE does.
* ``apply_rope_fusion``: Core's fused MLA YaRN RoPE is a Triton kernel (``fusions/fused_mla_yarn_rope_apply.py``),
  which does not run on fake tensors: traced unfused (:data:`ROPE_FUSION_NOTE`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from megatron_bridge_ext.estimate.standins import replaced_attributes
from megatron_bridge_ext.findings import ERROR, Finding

TRANSFORMER_ENGINE = "transformer_engine"
PROJECTIONS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
"""The projections multi-latent attention adds (``linear_proj``, its output projection, is the usual row-parallel
linear)."""
ROPE_FUSION_NOTE = ("apply_rope_fusion: Core's fused MLA YaRN RoPE (fusions/fused_mla_yarn_rope_apply.py, a Triton "
                    "kernel) traced unfused; the unfused RoPE keeps cos and sin [s, 1, 1, qk_pos_emb_head_dim] for the "
                    "query and the key of every layer (rope_utils.py L133-136), where the fused kernels keep only the "
                    "cached pair (L273, L661): at most 4 x s x qk_pos_emb_head_dim x element bytes per layer more; "
                    "the query, key and value they hand to attention have the same sizes")


def used(model) -> bool:
    return bool(getattr(model, "multi_latent_attention", False))


def findings(model) -> list[Finding]:
    """The variants of multi-latent attention the estimate does not model, one finding each (experimental attention
    variants are :mod:`.dsa`'s)."""
    if not used(model):
        return []
    out = []
    if getattr(model, "mla_down_proj_fusion", False):
        out.append(_not_modelled("model.mla_down_proj_fusion",
                                 "the fused q/kv down projection (Core's FusedMLASelfAttention) is not modelled by "
                                 "the estimate", "estimate with model.mla_down_proj_fusion=False"))
    if getattr(model, "fp8", None):
        out.append(_not_modelled("model.fp8",
                                 "FP8 on multi-latent attention's projections is not modelled by the estimate (their "
                                 "quantised weights and inputs are not counted)", "estimate the bf16 config"))
    if getattr(model, "hybrid_layer_pattern", None) or getattr(model, "hybrid_override_pattern", None):
        out.append(_not_modelled("model.multi_latent_attention",
                                 "multi-latent attention in a hybrid model is not modelled by the estimate",
                                 "read Bridge's figure beside it, or measure one training step on a GPU"))
    return out


def peft_findings(model, peft) -> list[Finding]:
    """Adapters other than Bridge's LoRA on multi-latent attention's projections: LoRA's are traced on the stand-ins
    Bridge takes for TE's modules (:func:`bridge_lora_view`); DoRA's and CanonicalLoRA's wrappers are not traced on
    those stand-ins."""
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.peft.lora import LoRA

    targets = set(getattr(peft, "target_modules", None) or [])
    named = sorted(targets & set(PROJECTIONS))
    if not used(model) or not named or isinstance(peft, LoRA):
        return []
    return [_not_modelled("peft.target_modules",
                          f"{type(peft).__name__} adapters on multi-latent attention's {', '.join(named)} are not "
                          "modelled by the estimate (LoRA's are)",
                          "estimate with LoRA on the same targets, or target linear_proj, linear_fc1 and linear_fc2")]


def layout_findings(model, *, transformer_impl: str) -> list[Finding]:
    """Latent ranks that TP does not divide where the local spec's column-parallel down projections split them
    (Transformer Engine's duplicated ones split nothing)."""
    if not used(model) or transformer_impl == TRANSFORMER_ENGINE:
        return []
    tp = model.tensor_model_parallel_size
    sizes = (("q_lora_rank", model.q_lora_rank), ("kv_lora_rank", model.kv_lora_rank + model.qk_pos_emb_head_dim))
    return [Finding("parallel_layout", ERROR, f"model.{name}",
                    f"TP={tp} does not divide {size} (kv_lora_rank + qk_pos_emb_head_dim for the key-value latent), "
                    "which the local spec's column-parallel down projection splits", "choose sizes that divide it")
            for name, size in sizes if size is not None and size % tp]


def trace_findings(model, *, attention: str, transformer_impl: str, fused: str) -> list[Finding]:
    """What the traced layer cannot be for this model: unfused attention (Core's local ``DotProductAttention``
    takes neither of multi-latent attention's key and value widths), and on the local spec a query norm without
    ``q_lora_rank``."""
    if not used(model):
        return []
    out = []
    if attention != fused:
        out.append(_not_modelled("attention",
                                 "unfused attention is not modelled with multi-latent attention: Core's local "
                                 "DotProductAttention takes no k_channels/v_channels (dot_product_attention.py L42-51) "
                                 "and cannot be built for it", "estimate with the fused attention (the default)"))
    if transformer_impl != TRANSFORMER_ENGINE and model.q_lora_rank is None and model.qk_layernorm:
        out.append(_not_modelled("model.qk_layernorm",
                                 "Core's local spec cannot build a query norm without q_lora_rank "
                                 "(mla_qk_norm_config.py L172-173)",
                                 "estimate on Transformer Engine's spec (transformer_impl='transformer_engine')"))
    return out


def turn_off_rope_fusion(model) -> Optional[str]:
    """Trace the unfused RoPE in place of Core's fused MLA kernel (a Triton kernel, which runs on no fake tensor)
    and say so; None where there is nothing to turn off. A RoPE other than YaRN is left fused, so that Core refuses
    it when the config is finalized (``transformer_config.py`` L2966-2967), as training would."""
    if not (used(model) and getattr(model, "apply_rope_fusion", False) and model.rope_type == "yarn"):
        return None
    model.apply_rope_fusion = False
    return ROPE_FUSION_NOTE


def _not_modelled(setting: str, message: str, fix: str) -> Finding:
    return Finding("unsupported_model", ERROR, setting, message, fix)


class _DuplicatedLinearSaves(torch.autograd.Function):
    """``x @ weight.T`` that keeps ``x`` only when the weight trains, as Transformer Engine's ``_Linear`` does
    (TE v2.17.1 ``module/linear.py`` L300 and L563-565: ``backward_needs_input = is_grad_enabled and
    weight.requires_grad``), and the weight itself."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.flatten(0, -2).t() @ x.flatten(0, -2) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


class DuplicatedLinear(torch.nn.Module):
    """Stands in for Core's ``TELinear`` with ``parallel_mode="duplicated"`` (``extensions/transformer_engine.py``
    L975-1003): the whole [output, input] weight on every TP rank, no communication, its input as it comes (the
    sequence shard under sequence parallelism). Returns ``(output, None)`` as Core's linears do."""

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: Optional[str], config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 skip_weight_param_allocation: bool = False, tp_group=None, name: Optional[str] = None):
        super().__init__()
        if parallel_mode != "duplicated" or bias or is_expert or skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear stands in for TELinear's duplicated mode without bias, outside the "
                             "experts, with its own weight (multi-latent attention's down projections, latent MoE's "
                             "projections)")
        self.config, self.in_features, self.out_features = config, input_size, output_size
        self.parallel_mode = None  # what Core hands TE for the duplicated mode (L996-1001), as TE's module keeps it
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))

    def forward(self, x):
        return _DuplicatedLinearSaves.apply(x, self.weight), None


class _KeepsNormOutput(torch.autograd.Function):
    """The identity, keeping its input for backward: TE's ``_LayerNormLinear`` keeps its norm-output shard when it
    returns the norm output, its weight frozen or not (``layernorm_linear.py`` v2.4 L356-358 and L437-447, as
    :mod:`..te` reads them), which Core's frozen-weight linear (``tensor_parallel/layers.py`` L415-417: the weight
    alone) does not keep."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class NormColumnParallelLinear(torch.nn.Module):
    """Stands in for Core's ``TELayerNormColumnParallelLinear``: Core's local norm of the input (``layernorm``, the
    config's RMSNorm or LayerNorm over ``input_size``), then Core's ``ColumnParallelLinear`` (``linear``) with the
    arguments the fused module was given. The pair keeps what TE's fused module keeps (the norm's input and
    statistics, and the norm-output shard while the weight trains: :mod:`..te`), as the local spec's separate norm
    and linear do for ``linear_qkv``. Returns what the linear returns, ``(output, bias)``; with
    ``return_layernorm_output`` (what Bridge's LoRA sets on TE's module, ``peft/utils.py`` L598-600)
    ``((output, norm output), bias)``, the norm output gathered over the sequence under sequence parallelism with
    ``return_layernorm_output_gathered`` (L608-611), as TE returns them; the shard kept while the weight is frozen
    (:class:`_KeepsNormOutput`). ``in_features`` and ``out_features`` (this rank's columns), ``config`` and
    ``tp_group`` are the attributes of TE's module that Bridge reads (L554, L591-596, L339-342)."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        from megatron.core.models.backends import LocalSpecProvider
        from megatron.core.tensor_parallel import ColumnParallelLinear

        super().__init__()
        norm = LocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
        self.layernorm = norm(config=config, hidden_size=input_size, eps=config.layernorm_epsilon)
        self.linear = ColumnParallelLinear(input_size, output_size, config=config, **kwargs)
        self.config, self.tp_group, self.in_features = config, self.linear.tp_group, input_size
        self.out_features = self.linear.output_size_per_partition
        self.return_layernorm_output = self.return_layernorm_output_gathered = False

    def forward(self, x):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        normed = self.layernorm(x)
        if not self.return_layernorm_output:
            return self.linear(normed)
        out, bias = self.linear(normed)
        if not self.linear.weight.requires_grad:
            normed = _KeepsNormOutput.apply(normed)
        if self.config.sequence_parallel and self.return_layernorm_output_gathered:
            normed = gather_from_sequence_parallel_region(normed, group=self.tp_group)
        return (out, normed), bias


def te_layout(attention_spec) -> None:
    """Give Core's local MLA attention spec (``get_gpt_layer_local_submodules``) Transformer Engine's layout of
    ``get_gpt_layer_with_transformer_engine_submodules`` (L295-318): duplicated down projections, no standalone
    query and key-value norms (with ``qk_layernorm`` Core's resolver fuses them into the up projections, under
    :func:`te_modules`)."""
    from megatron.core.transformer.identity_op import IdentityOp

    sub = attention_spec.submodules
    sub.linear_q_down_proj = sub.linear_kv_down_proj = DuplicatedLinear
    sub.q_layernorm = sub.kv_layernorm = IdentityOp


@contextlib.contextmanager
def te_modules() -> Iterator[None]:
    """While the model is built: Core's MLA layer takes :class:`DuplicatedLinear` for ``TELinear`` (so that it asks
    for the ``duplicated`` mode, multi_latent_attention.py L525-526), and Core's query and key-value norm resolver
    reads Transformer Engine's backend, whatever the config's ``transformer_impl``, with
    :class:`NormColumnParallelLinear` as its fused norm-linear (so that it fuses the norms as under TE,
    ``mla_qk_norm_config.py`` L43-48). Everything is put back on exit."""
    from megatron.core.extensions import transformer_engine_spec_provider as te_spec
    from megatron.core.transformer import mla_qk_norm_config, multi_latent_attention

    replaced = {(multi_latent_attention, "TELinear"): DuplicatedLinear,
                (te_spec, "TELayerNormColumnParallelLinear"): NormColumnParallelLinear,
                (mla_qk_norm_config, "get_backend"): lambda transformer_impl: te_spec.TESpecProvider()}
    with replaced_attributes(replaced):
        yield


@contextlib.contextmanager
def bridge_lora_view() -> Iterator[None]:
    """While Bridge's PEFT transforms the model: its ``get_adapter_attributes_from_linear`` (``peft/utils.py``
    L522-652) takes :class:`DuplicatedLinear` for ``TELinear`` (L629-633: the whole input and output, LoRA-B
    gathered, no sequence-parallel communication since TE's module has ``parallel_mode`` None, L562-564) and
    :class:`NormColumnParallelLinear` for ``TELayerNormColumnParallelLinear`` (L591-624: the norm output returned,
    gathered by the module under sequence parallelism), with TE's other classes kept only where they are classes
    (without TE Core's are placeholders on which ``isinstance`` raises), and TE's version read as the modelled
    release's (L612). Bridge so builds the adapters it builds on TE's modules. Everything is put back on exit."""
    from megatron.bridge.peft import utils

    from megatron_bridge_ext.estimate.te import MODELLED_VERSION

    def classes(*found):
        return tuple(c for c in found if isinstance(c, type))

    replaced = {"HAVE_TE": True, "TELinear": DuplicatedLinear,
                "TELayerNormColumnParallelLinear": NormColumnParallelLinear,
                "TECL": classes(*utils.TECL) + (NormColumnParallelLinear,), "TERL": classes(*utils.TERL),
                "version": lambda distribution: MODELLED_VERSION}
    saved = {name: getattr(utils, name) for name in replaced}
    for name, value in replaced.items():
        setattr(utils, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(utils, name, value)


def assumption(model, transformer_impl: str) -> Optional[str]:
    """How the estimate traced the model's multi-latent attention, or None without it."""
    if not used(model):
        return None
    layout = ("Transformer Engine's layout: duplicated down projections (a stand-in for TELinear's), the "
              "query and key-value norms fused into the up projections (Core's local norm and column-parallel linear)"
              if transformer_impl == TRANSFORMER_ENGINE else
              "Core's local spec: column-parallel down projections, gathered over TP")
    return (f"multi-latent attention: Megatron Core's MLASelfAttention traced in {layout}; core attention by the "
            "fused stand-in, keys and queries of qk_head_dim + qk_pos_emb_head_dim, values of v_head_dim per head "
            "(estimate.features.mla)")
