"""Estimate settings built by hand, for the tests of what reads them (the roofline, the levers' costs and advice, the
config line): every field explicit in one place, a test replacing the ones its figures rest on."""

from __future__ import annotations

import types
from dataclasses import replace

import torch

from megatron_bridge_ext.estimate.settings import MlaSettings, MoeSettings, PeftSettings, ReportSettings, Settings

REPORTS = ReportSettings(log_interval=1, train_iters=None, cuda_graph_first_iteration=None, wgrad_deferral_limit=None)
"""Bridge's reporting defaults: memory printed from iteration 1, no CUDA graphs, no deferred wgrad."""

GPT_STAGE = Settings(
    tp=2, pp=1, vpp=None, cp=1, dp=1, sequence_parallel=True, seq_length=1024, micro_batch=1, num_microbatches=4,
    dtype="bfloat16", fp8=None, stage=0, layers_on_stage=2, hidden=1024, ffn=4096, heads=8, query_groups=8,
    kv_channels=128, num_layers=2, gated_linear_unit=False, vocab_size=32000, recompute_granularity=None,
    recompute_modules=(), attention="local", transformer_impl="local", device="cpu", distributed_optimizer=True,
    peft=None, hybrid=None, reports=REPORTS, moe=None, mla=None)
"""A dense GPT of 2 layers on one stage, TP 2 with SP, full fine-tuning, no recompute."""


def gpt_stage(**fields) -> Settings:
    """:data:`GPT_STAGE` with ``fields`` replaced."""
    return replace(GPT_STAGE, **fields)


def lora(dim: int = 8, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), *, strategy: str = "off",
         kind: str = "lora") -> PeftSettings:
    """Bridge's LoRA (DoRA, CanonicalLoRA with ``kind``) of rank ``dim`` on ``targets``, its LoRA-A input strategy
    ``strategy``."""
    names = {"lora": "LoRA", "dora": "DoRA", "canonical_lora": "CanonicalLoRA"}
    return PeftSettings(name=f"megatron.bridge.peft.{kind}.{names[kind]}", kind=kind, lora_dim=dim,
                        lora_targets=tuple(targets), sequence_parallel_input_strategy=strategy)


def experts(layers_on_stage: int, *, experts: int = 8, topk: int = 2, ffn: int = 512, ep: int = 1, etp: int = 1,
            dispatcher: str = "alltoall", shared_ffn: int = 0, routed_tokens_per_layer: int = 0,
            imbalance: float = 1.0) -> MoeSettings:
    """An MoE model's experts (balanced unless ``imbalance`` says), with ``layers_on_stage`` MoE layers on the stage."""
    return MoeSettings(experts=experts, topk=topk, ffn=ffn, ep=ep, etp=etp, local_experts=experts // ep,
                       dispatcher=dispatcher, imbalance=imbalance, layers_on_stage=layers_on_stage,
                       routed_tokens_per_layer=routed_tokens_per_layer, shared_ffn=shared_ffn)


def latent(q_lora_rank=1536, kv_lora_rank: int = 512, qk_head_dim: int = 128, qk_pos_emb_head_dim: int = 64,
           v_head_dim: int = 128) -> MlaSettings:
    """Multi-latent attention's sizes (DeepSeek-V3's by default; ``q_lora_rank=None``: the query projected
    directly)."""
    return MlaSettings(q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_head_dim=qk_head_dim,
                       qk_pos_emb_head_dim=qk_pos_emb_head_dim, v_head_dim=v_head_dim)


def optimizer_config(**fields) -> types.SimpleNamespace:
    """An ``OptimizerConfig``'s fields the estimate reads, at Core's defaults for Adam with the distributed optimizer
    and fp32 states, bf16 parameters; ``fields`` change any of them."""
    base = dict(optimizer="adam", use_precision_aware_optimizer=False, use_distributed_optimizer=True,
                main_params_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                fp8_recipe=None, bf16=True, store_param_remainders=False, decoupled_weight_decay=True,
                optimizer_cpu_offload=False, optimizer_offload_fraction=0.0)
    return types.SimpleNamespace(**{**base, **fields})
