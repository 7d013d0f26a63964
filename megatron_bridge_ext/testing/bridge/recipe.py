"""The tiny Bridge recipe: Megatron Bridge's vanilla GPT recipe shrunk to a model that trains in seconds on 2 CPU ranks.

fp32 so that Bridge's LoRA and ours compare exactly, Megatron Core's local layer spec, TP=2 with sequence
parallelism. ``mbx demo --bridge``, the tests of Bridge's loop and the README's example use it;
:func:`with_experts` makes its MLPs a mixture of experts (``moe=True`` in the config builders).
"""

from __future__ import annotations

from typing import Optional

LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_RANK, LORA_ALPHA = 8, 16
BASE_ITERATIONS = 2  # pretraining steps that make the base checkpoint LoRA fine-tunes from
SAVE_INTERVAL = 2
TENSOR_PARALLEL = 2  # = ranks started by mbx demo --bridge
LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 2, 64, 4, 32, 256
FFN = 4 * HIDDEN  # Megatron Core's default ffn_hidden_size
MICRO_BATCH, GLOBAL_BATCH = 2, 4
EXPERTS, MOE_TOPK, MOE_FFN = 4, 2, 32  # the MoE recipe: routed experts per layer, top-k, each expert's FFN width
EXPERT_PARALLEL, EXPERT_TENSOR_PARALLEL = 2, 1  # folded onto the TENSOR_PARALLEL ranks: experts/2 on each


def tiny_gpt(cfg, *, train_iters: int, dtype=None):
    """Shrink the Bridge GPT recipe ``cfg`` (e.g. ``vanilla_gpt_pretrain_config()``) to the demo's model, in place.

    2 layers, hidden 64, 4 heads (FFN 4h = 256), sequence 32, vocabulary 256; TP=2 with sequence
    parallelism; ``dtype`` for parameters (fp32 by default), no mixed precision, no
    dropout; 2 micro-batches of 2 per iteration; Bridge's mock GPT data; torch_dist checkpoints
    every 2 iterations, saved synchronously. Returns ``cfg``. Applies ``core_local_norm_sequence_parallel``
    (the local spec's norm refuses sequence parallelism upstream).
    """
    import torch
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.training.config import MockGPTDatasetConfig

    from megatron_bridge_ext.patches import core_local_norm_sequence_parallel

    core_local_norm_sequence_parallel.PATCH.apply()
    dtype = dtype or torch.float32
    model = cfg.model
    model.num_layers, model.hidden_size, model.num_attention_heads = LAYERS, HIDDEN, HEADS
    model.seq_length, model.vocab_size = SEQ, VOCAB
    model.transformer_layer_spec = local_layer_spec  # Megatron Core's local spec: runs without TE too
    model.tensor_model_parallel_size, model.sequence_parallel = TENSOR_PARALLEL, True
    model.hidden_dropout = model.attention_dropout = 0.0  # runs that compare LoRA variants stay deterministic
    model.gradient_accumulation_fusion = False
    model.bf16 = model.fp16 = False
    model.params_dtype = model.pipeline_dtype = dtype
    if dtype != torch.float32:  # the local spec builds its norms in fp32 whatever params_dtype says: cast them
        model.register_pre_wrap_hook(lambda chunks: [chunk.to(dtype) for chunk in chunks], prepend=True)
    cfg.mixed_precision = None
    cfg.optimizer.bf16 = cfg.optimizer.fp16 = False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.grad_reduce_in_fp32 = False  # gradients in the parameters' dtype (fp64 runs stay fp64)
    cfg.scheduler.lr_warmup_iters = 0
    cfg.scheduler.lr_decay_iters = cfg.scheduler.lr_wsd_decay_iters = None
    cfg.train.train_iters = train_iters
    cfg.train.global_batch_size, cfg.train.micro_batch_size = GLOBAL_BATCH, MICRO_BATCH
    cfg.validation.eval_iters, cfg.validation.eval_interval = 0, None
    cfg.dataset = MockGPTDatasetConfig(
        seq_length=model.seq_length, random_seed=1234, split="9999,8,2", reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, dataloader_type="single", num_workers=0,
        pin_memory=False, persistent_workers=False)
    cfg.tokenizer.vocab_size = model.vocab_size
    cfg.logger.log_interval, cfg.logger.tensorboard_dir = 1, None
    cfg.checkpoint.ckpt_format, cfg.checkpoint.async_save = "torch_dist", False
    cfg.checkpoint.save_interval = SAVE_INTERVAL
    return cfg


def with_experts(cfg):
    """Make every layer's MLP of the tiny recipe ``cfg`` a mixture of experts, in place; returns ``cfg``.

    Megatron Core's MoE layer of the local spec: :data:`EXPERTS` SequentialMLP experts (one linear per
    expert, no grouped GEMM) of width :data:`MOE_FFN`, a top-:data:`MOE_TOPK` router, the allgather token
    dispatcher; expert parallelism :data:`EXPERT_PARALLEL` with expert tensor parallelism
    :data:`EXPERT_TENSOR_PARALLEL`, on the same ranks as the tensor-parallel layout.
    """
    model = cfg.model
    model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size = EXPERTS, MOE_TOPK, MOE_FFN
    model.moe_grouped_gemm, model.moe_token_dispatcher_type = False, "allgather"
    model.expert_model_parallel_size, model.expert_tensor_parallel_size = EXPERT_PARALLEL, EXPERT_TENSOR_PARALLEL
    return cfg


def tiny_recipe(*, train_iters: int, dtype=None, moe: bool = False):
    """Bridge's vanilla GPT recipe, shrunk by :func:`tiny_gpt` (and with ``moe``, :func:`with_experts`)."""
    from megatron.bridge.recipes.gpt import vanilla_gpt_pretrain_config

    cfg = tiny_gpt(vanilla_gpt_pretrain_config(), train_iters=train_iters, dtype=dtype)
    return with_experts(cfg) if moe else cfg


def bridge_lora():
    """Megatron Bridge's own LoRA on the four linear layers (with ``bridge_truthful_te_detection`` applied)."""
    from megatron.bridge.peft.lora import LoRA

    from megatron_bridge_ext.patches import bridge_truthful_te_detection

    bridge_truthful_te_detection.PATCH.apply()
    return LoRA(target_modules=list(LORA_TARGETS), dim=LORA_RANK, alpha=LORA_ALPHA)


def pretrain_config(save: str, *, moe: bool = False):
    """The base model: :data:`BASE_ITERATIONS` pretraining steps, saved to ``save``."""
    cfg = tiny_recipe(train_iters=BASE_ITERATIONS, moe=moe)
    cfg.checkpoint.save, cfg.checkpoint.save_interval = save, BASE_ITERATIONS
    return cfg


def finetune_config(pretrained: str, *, train_iters: int = 4, save: Optional[str] = None, load: Optional[str] = None,
                    ckpt_step: Optional[int] = None, dtype=None, moe: bool = False):
    """LoRA fine-tuning of the base model with Bridge's LoRA (apply a MemoryConfig for ours); ``moe`` as the base."""
    cfg = tiny_recipe(train_iters=train_iters, dtype=dtype, moe=moe)
    cfg.checkpoint.pretrained_checkpoint = pretrained
    cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.ckpt_step = save, load, ckpt_step
    cfg.peft = bridge_lora()
    return cfg
