"""A small Megatron Core GPTModel (local spec) with Bridge's LoRA, for tests, the demo and benchmarks.

Real Megatron Core layers (ColumnParallelLinear/RowParallelLinear, sequence-parallel mappings,
DotProductAttention) at a size that trains in seconds on a CPU. Requires torch.distributed and
Megatron Core's parallel state to be initialised (see :mod:`megatron_bridge_ext.testing.distributed`).
Building the model applies the ``core_local_norm_sequence_parallel`` patch (the local spec's norm
refuses sequence parallelism upstream); applying a PEFT applies ``bridge_truthful_te_detection``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from megatron_bridge_ext.patches import bridge_truthful_te_detection, core_local_norm_sequence_parallel
from megatron_bridge_ext.peft import kinds

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float64": torch.float64}


@dataclass(kw_only=True)
class TinyGPTShape:
    """Shape and parallel layout of the tiny model."""

    layers: int = 2
    hidden: int = 64
    ffn: int = 128
    heads: int = 4
    kv_heads: int = 2
    seq: int = 32
    micro_batch: int = 2
    vocab: int = 128
    tp: int = 2
    sequence_parallel: bool = True
    dtype: str = "float32"
    swiglu: bool = False
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    """The adapted layers; CanonicalLoRA adapts linear_qkv as linear_q, _k and _v, linear_fc1 as up and gate."""
    peft: str = "lora"
    """The LoRA-family kind: ``lora``, ``dora`` or ``canonical_lora`` (:mod:`megatron_bridge_ext.peft.kinds`)."""
    experts: int = 0
    """Routed experts per MoE layer; 0 builds the dense MLP. With experts, every layer's MLP is Megatron Core's
    MoE layer of the local spec: a top-k router, the token dispatcher and SequentialMLP experts."""
    topk: int = 1
    moe_ffn: int = 64
    """Each expert's FFN width."""
    dispatcher: str = "allgather"
    """Megatron Core's ``moe_token_dispatcher_type``."""
    ep: int = 1
    """Expert-parallel size (Core folds the expert layout onto the TP ranks)."""
    etp: int = 1
    """Expert tensor-parallel size."""
    shared_ffn: int = 0
    """Core's ``moe_shared_expert_intermediate_size``: with experts, a shared-expert MLP of this width beside the
    routed ones in every MoE layer; 0 builds none."""
    shared_overlap: bool = False
    """Core's ``moe_shared_expert_overlap``: the shared experts' communication runs inside the (all-to-all)
    dispatcher; their linears then do none of their own."""
    moe_layer_freq: int | list[int] = 1
    """Core's ``moe_layer_freq``: which layers are MoE (1 in a list) and which dense (0), e.g. ``[0, 1]``; an int
    N makes every N-th layer MoE. With dense layers the decoder is Core's block spec of the local spec."""
    mla: bool = False
    """Multi-latent attention (Core's ``MLASelfAttention`` of the local spec, RMSNorm) in place of grouped-query
    attention; ``kv_heads`` is then unused. Core's local ``DotProductAttention`` cannot take its key and value widths:
    its core attention is :class:`~megatron_bridge_ext.testing.fused_attention.CpuFusedAttention`."""
    q_lora_rank: int | None = None
    """Multi-latent attention's query latent (None: the query projected directly from the hidden state)."""
    kv_lora_rank: int = 16
    qk_head_dim: int = 16
    """The query and key width per head without RoPE."""
    qk_pos_emb_head_dim: int = 8
    """The query and key width per head with RoPE."""
    v_head_dim: int = 12
    qk_layernorm: bool = False
    """Multi-latent attention's query and key-value latent norms (Core's local spec cannot build a query norm
    without ``q_lora_rank``)."""
    rope_type: str = "yarn"
    """Multi-latent attention's RoPE: ``yarn`` (DeepSeek-V3's) or ``rope``."""
    mtp: int = 0
    """Multi-token prediction depths (Core's ``mtp_num_layers``): Core's MTP block of the local backend after the
    decoder, each depth a transformer layer of the decoder's last layer's spec; 0 builds none."""
    mtp_loss_scaling_factor: float = 0.1

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {sorted(DTYPES)}") from None


def shape_problems(shape: TinyGPTShape) -> list[str]:
    """What Megatron Core (or the LoRA layout) would refuse about ``shape``, one line each, naming the option."""
    problems = []
    if shape.peft not in kinds.KINDS:
        problems.append(f"--peft={shape.peft}: use one of {', '.join(kinds.KINDS)}")
    for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "seq", "micro_batch", "lora_rank", "tp"):
        if getattr(shape, name) < 1:
            problems.append(f"--{name.replace('_', '-')}={getattr(shape, name)}: must be at least 1")
    if problems:
        return problems
    checks = (
        (shape.hidden % shape.heads, f"--hidden={shape.hidden} is not divisible by --heads={shape.heads}"),
        (shape.heads % shape.kv_heads, f"--heads={shape.heads} is not divisible by --kv-heads={shape.kv_heads}"),
        (shape.heads % shape.tp, f"--heads={shape.heads} is not divisible by --tp={shape.tp}"),
        (shape.kv_heads % shape.tp, f"--kv-heads={shape.kv_heads} is not divisible by --tp={shape.tp}"),
        (shape.ffn % shape.tp, f"--ffn={shape.ffn} is not divisible by --tp={shape.tp}"),
        (shape.lora_rank % shape.tp, f"--lora-rank={shape.lora_rank} is not divisible by --tp={shape.tp} "
                                     "(Bridge shards LoRA-A on the rank dimension)"),
        (shape.sequence_parallel and shape.seq % shape.tp,
         f"--seq={shape.seq} is not divisible by --tp={shape.tp} (sequence parallelism splits the sequence)"),
        (shape.vocab % shape.tp, f"vocab {shape.vocab} is not divisible by --tp={shape.tp}"),
        (isinstance(shape.moe_layer_freq, list) and len(shape.moe_layer_freq) != shape.layers,
         f"moe_layer_freq={shape.moe_layer_freq} does not mark each of the {shape.layers} layers (1 MoE, 0 dense)"),
    )
    return [message for failed, message in checks if failed]


def transformer_config(shape: TinyGPTShape, **overrides):
    """The Megatron Core TransformerConfig for ``shape``; ``overrides`` are extra config fields."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = shape.torch_dtype
    fields = dict(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        tensor_model_parallel_size=shape.tp,
        sequence_parallel=shape.sequence_parallel and shape.tp > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        gated_linear_unit=shape.swiglu,
        activation_func=torch.nn.functional.silu if shape.swiglu else torch.nn.functional.gelu,
    )
    fields.update(_moe_fields(shape))
    if shape.mtp:
        fields.update(mtp_num_layers=shape.mtp, mtp_loss_scaling_factor=shape.mtp_loss_scaling_factor)
    fields.update(overrides)  # e.g. attention_dropout, recompute settings
    if shape.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**{**fields, **_mla_fields(shape)})
    return TransformerConfig(**fields)


def _mla_fields(shape: TinyGPTShape) -> dict:
    """Megatron Core's multi-latent attention fields for ``shape``."""
    return dict(multi_latent_attention=True, q_lora_rank=shape.q_lora_rank, kv_lora_rank=shape.kv_lora_rank,
                qk_head_dim=shape.qk_head_dim, qk_pos_emb_head_dim=shape.qk_pos_emb_head_dim,
                v_head_dim=shape.v_head_dim, qk_layernorm=shape.qk_layernorm, rope_type=shape.rope_type,
                normalization="RMSNorm", num_query_groups=shape.heads)


def _moe_fields(shape: TinyGPTShape) -> dict:
    """Megatron Core's MoE config fields for ``shape``; none for a dense shape, so that its config is unchanged."""
    if not shape.experts:
        return {}
    fields = dict(num_moe_experts=shape.experts, moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.moe_ffn,
                  moe_token_dispatcher_type=shape.dispatcher, expert_model_parallel_size=shape.ep,
                  expert_tensor_parallel_size=shape.etp,
                  moe_router_pre_softmax=shape.topk == 1)  # Core refuses top-1 without it: a softmax over one is 1
    if shape.shared_ffn:
        fields.update(moe_shared_expert_intermediate_size=shape.shared_ffn,
                      moe_shared_expert_overlap=shape.shared_overlap)
    if has_dense_layers(shape):
        fields.update(moe_layer_freq=copy.copy(shape.moe_layer_freq))
    return fields


def has_dense_layers(shape: TinyGPTShape) -> bool:
    """Whether an MoE shape's ``moe_layer_freq`` makes some layers dense (Core's default, 1, makes none)."""
    return bool(shape.experts) and shape.moe_layer_freq != 1 and shape.moe_layer_freq != [1] * shape.layers


def moe_layers(shape: TinyGPTShape) -> list[int]:
    """The indices of the MoE layers, as Core reads ``moe_layer_freq`` (gpt_layer_specs.get_gpt_decoder_layer_specs)."""
    if not shape.experts:
        return []
    freq = shape.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(shape.layers)]
    return [i for i, moe in enumerate(pattern) if moe]


def tiny_config(shape, peft=None, **config_overrides):
    """A Bridge ConfigContainer whose model is exactly the one :func:`build_gpt` builds for ``shape``.

    Same Megatron Core TransformerConfig fields, vocabulary and untied output layer, with ``peft`` and extra
    config fields as the demo passes them, so that ``estimate(tiny_config(...))`` can be set beside a measured
    run of the same model.
    """
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.models.mla_provider import MLAModelProvider
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config

    core = transformer_config(shape, **config_overrides)
    fields = {f.name: getattr(core, f.name) for f in dataclasses.fields(type(core)) if f.init}
    fields["transformer_impl"] = "local"  # the demo builds Megatron Core's local layer spec
    provider = (MLAModelProvider if shape.mla else GPTModelProvider)(
        **fields, vocab_size=shape.vocab, seq_length=shape.seq, share_embeddings_and_output_weights=False,
        position_embedding_type="rope")
    if has_dense_layers(shape):
        provider.transformer_layer_spec = _decoder_block_spec
    cfg = vanilla_gpt_pretrain_config()
    cfg.model, cfg.peft = provider, peft
    cfg.mixed_precision = None  # the tiny config's fields already carry its dtype
    cfg.train.micro_batch_size = shape.micro_batch
    cfg.train.global_batch_size = shape.micro_batch
    return cfg


def build_gpt(shape: TinyGPTShape, seed: int = 1234, layer_spec=None, **config_overrides):
    """Build the GPTModel on this rank's device, with identical weights for identical seeds.

    ``layer_spec`` replaces Megatron Core's local layer spec (the default; with ``shape.experts``, its MoE
    variant with SequentialMLP experts).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_bridge_ext.testing.distributed import device

    core_local_norm_sequence_parallel.PATCH.apply()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = transformer_config(shape, **copy.deepcopy(config_overrides))  # Core may edit lists in place
    spec = layer_spec if layer_spec is not None else _local_spec(shape, config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq,
        position_embedding_type="rope",
        mtp_block_spec=_mtp_block_spec(shape, config, spec),
    )
    return model.to(device=device(), dtype=shape.torch_dtype)


def _mtp_block_spec(shape: TinyGPTShape, config, spec):
    """Core's MTP block of the local backend around the decoder's last layer's spec; None without MTP."""
    if not shape.mtp:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)


def _local_spec(shape: TinyGPTShape, config):
    """Megatron Core's local layer spec: dense, or MoE with one linear per expert (no grouped GEMM); with dense
    and MoE layers mixed, Core's decoder block spec of those two local specs. With multi-latent attention, the
    local spec's ``MLASelfAttention`` with :class:`~megatron_bridge_ext.testing.fused_attention.CpuFusedAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if shape.mla:
        return _mla_spec(shape, config)
    if not shape.experts:
        return get_gpt_layer_local_spec()
    if has_dense_layers(shape):
        return _decoder_block_spec(config)
    return get_gpt_layer_local_spec(num_experts=shape.experts, moe_grouped_gemm=False)


def _mla_spec(shape: TinyGPTShape, config):
    """The local spec with multi-latent attention (dense or MoE layers of one kind)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_bridge_ext.testing.fused_attention import CpuFusedAttention

    if has_dense_layers(shape):
        raise ValueError("the tiny multi-latent model has layers of one kind (moe_layer_freq=1)")
    spec = get_gpt_layer_local_spec(num_experts=shape.experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=shape.qk_layernorm, multi_latent_attention=True,
                                    normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = CpuFusedAttention
    return spec


def _decoder_block_spec(config, vp_stage=None):
    """Core's decoder block spec of the local dense and MoE layer specs, in ``config.moe_layer_freq``'s order
    (a callable of the config, as Bridge's provider takes its ``transformer_layer_spec``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)


def bridge_lora(shape: TinyGPTShape, **fields):
    """Megatron Bridge's own PEFT of kind ``shape.peft`` for ``shape`` (the upstream baseline)."""
    return kinds.bridge_class(shape.peft)(**peft_fields(shape), **fields)


def peft_fields(shape: TinyGPTShape) -> dict:
    """The fields that make a LoRA-family PEFT of kind ``shape.peft`` adapt ``shape.lora_targets``."""
    return {"target_modules": kinds.target_names(shape.peft, shape.lora_targets), "dim": shape.lora_rank,
            "alpha": shape.lora_alpha}


def apply_peft(model, peft, seed: int = 4321):
    """Apply a Bridge PEFT object (freeze base, add adapters) with deterministic adapter init.

    LoRA-B (every adapter's ``linear_out``, CanonicalLoRA's split adapters included) is
    zero-initialised upstream; it is re-drawn here so that adapters contribute to outputs and
    gradients in tests and benchmarks.
    """
    bridge_truthful_te_detection.PATCH.apply()  # Bridge's own LoRA needs it as much as ours
    torch.manual_seed(seed)
    model = peft(model, training=True)
    model = model[0] if isinstance(model, list) else model
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".linear_out.weight") and ".adapter." in name:
                param.copy_(torch.randn(param.shape, generator=generator).mul_(0.02).to(param))
    return model


def synthetic_batch(shape: TinyGPTShape, step: int = 0):
    """Deterministic tokens, positions, labels and loss mask (same on every rank)."""
    from megatron_bridge_ext.testing.distributed import device

    generator = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq + 1), generator=generator)
    dev = device()
    return {
        "input_ids": tokens[:, :-1].to(dev),
        "position_ids": torch.arange(shape.seq).unsqueeze(0).expand(shape.micro_batch, -1).to(dev),
        "labels": tokens[:, 1:].to(dev),
    }


def loss_of(model, batch) -> torch.Tensor:
    """Mean token cross-entropy of one forward pass."""
    per_token = model(batch["input_ids"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
    return per_token.to(torch.promote_types(per_token.dtype, torch.float32)).mean()
