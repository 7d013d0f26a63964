"""Megatron-FSDP (``ddp.use_megatron_fsdp``): what Megatron Core 0.19.2 and Bridge 0.6.2 enforce or change when it
is on, one rule each, read by the estimate (:mod:`megatron_bridge_ext.estimate.fsdp`) and the search
(:mod:`megatron_bridge_ext.search.candidates`).

Bridge wraps the model in Core's ``FullyShardedDataParallel`` (``training/setup.py`` L69-72; ``mcore_fsdp_adapter.py``)
when ``dist.use_megatron_fsdp`` or ``ddp.use_megatron_fsdp`` is on, after ``_validate_and_apply_megatron_fsdp_configs``
(``training/config.py`` L1065-1115) has turned both on, the distributed optimizer on (L1073-1077) and, with the
precision-aware optimizer, ``megatron_fsdp_use_decoupled_grad`` on (L1079-1084). TP, CP, PP and EP combine with it:
its buffers shard over the DP x CP group, the experts' over the expert-DP group (``mcore_fsdp_adapter.py``
L345-369), each TP/PP rank's own parameters.
"""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""``ddp.data_parallel_sharding_strategy`` values Core accepts (``param_and_grad_buffer.py`` L2322-2342): what each
shards over DP, in that order: nothing, the optimizer's main weights and states, and the gradients, and the
parameters."""
SETTING = "ddp.use_megatron_fsdp"
GRAD_ACC_FUSION_TE = "2.10"
"""Transformer Engine release Core asks for with ``gradient_accumulation_fusion`` (``mcore_fsdp_adapter.py``
L147-151)."""


def enabled(ddp, dist=None) -> bool:
    """Megatron-FSDP is on: either flag (Bridge turns both on, ``training/config.py`` L1345-1346)."""
    return bool(getattr(ddp, "use_megatron_fsdp", False) or getattr(dist, "use_megatron_fsdp", False))


def strategy(ddp) -> str:
    return getattr(ddp, "data_parallel_sharding_strategy", "no_shard")


def findings(cfg, provider, optimizer, ddp, *, te_version: str) -> tuple[list[Finding], list[Finding]]:
    """With Megatron-FSDP on: the rules Core or Bridge enforce that the config breaks, and the settings the estimate
    does not model with it, one line each; ``te_version``: the Transformer Engine release the estimate models."""
    if not enabled(ddp, getattr(cfg, "dist", None)):
        return [], []
    return _enforced(cfg, provider, ddp, te_version), _unmodelled(provider, optimizer, ddp)


def _refuse(setting: str, message: str, fix: str) -> Finding:
    return Finding("megatron_fsdp", ERROR, setting, message, fix)


def _not_modelled(setting: str, message: str, fix: str) -> Finding:
    return Finding("unsupported_model", ERROR, setting, message, fix)


def _enforced(cfg, provider, ddp, te_version: str) -> list[Finding]:
    from packaging.version import Version

    out = []
    if strategy(ddp) not in STRATEGIES:
        out.append(_refuse("ddp.data_parallel_sharding_strategy", f"{strategy(ddp)!r} is not a Megatron-FSDP "
                           "strategy (param_and_grad_buffer.py L2339-2342)", f"use one of {', '.join(STRATEGIES)}"))
    if getattr(getattr(cfg, "dist", None), "use_torch_fsdp2", False):
        out.append(_refuse("dist.use_torch_fsdp2", "Megatron-FSDP and torch FSDP2 are exclusive (Bridge "
                           "training/config.py L1342-1343)", "turn one of them off"))
    checkpoint = getattr(cfg, "checkpoint", None)
    if (getattr(checkpoint, "save", None) or getattr(checkpoint, "load", None)) and \
            getattr(checkpoint, "ckpt_format", None) != "fsdp_dtensor":
        out.append(_refuse("checkpoint.ckpt_format", "Megatron-FSDP saves and loads only the fsdp_dtensor format "
                           "(Bridge training/config.py L1097-1101)", "set checkpoint.ckpt_format=fsdp_dtensor"))
    if strategy(ddp) == "optim_grads_params" and \
            getattr(getattr(cfg, "train", None), "check_weight_hash_across_dp_replicas_interval", None) is not None:
        out.append(_refuse("train.check_weight_hash_across_dp_replicas_interval", "sharded parameters have no "
                           "replicas to hash under optim_grads_params (Bridge training/config.py L1111-1115)",
                           "set it to null"))
    if getattr(provider, "gradient_accumulation_fusion", False) and Version(te_version) < Version(GRAD_ACC_FUSION_TE):
        out.append(_refuse("model.gradient_accumulation_fusion", f"Megatron-FSDP fuses it only with Transformer "
                           f"Engine >= {GRAD_ACC_FUSION_TE} (mcore_fsdp_adapter.py L147-151)",
                           "set model.gradient_accumulation_fusion=false"))
    if getattr(provider, "overlap_moe_expert_parallel_comm", False) and getattr(ddp, "fsdp_double_buffer", False):
        out.append(_refuse("ddp.fsdp_double_buffer", "the 1F1B expert-parallel overlap refuses FSDP double buffers "
                           "(mcore_fsdp_adapter.py L168-172)", "set ddp.fsdp_double_buffer=false"))
    return out


def _unmodelled(provider, optimizer, ddp) -> list[Finding]:
    out = []
    if getattr(provider, "fp8", None):
        out.append(_not_modelled("model.fp8", "FP8 under Megatron-FSDP (Transformer Engine's quantised copies of "
                                 "each gathered unit) is not modelled", "estimate the bf16 config"))
    if (getattr(ddp, "num_distributed_optimizer_instances", 1) or 1) > 1:
        out.append(_not_modelled("ddp.num_distributed_optimizer_instances", "hybrid FSDP (an outer DP group, "
                                 "param_and_grad_buffer.py L2491-2507) is not modelled",
                                 "estimate with ddp.num_distributed_optimizer_instances=1"))
    if getattr(ddp, "fsdp_double_buffer", False) or getattr(ddp, "nccl_ub", False):
        out.append(_not_modelled("ddp.fsdp_double_buffer", "Megatron-FSDP's persistent double-buffer pools "
                                 "(FixedPoolAllocator, param_and_grad_buffer.py L2518-2579; nccl_ub turns them on) "
                                 "are not modelled", "estimate with ddp.fsdp_double_buffer=false, ddp.nccl_ub=false"))
    if getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False):
        out.append(_not_modelled("ddp.fp8_param_gather", "Megatron-FSDP's FP8 parameter buffers (uint8 and "
                                 "transpose buffers, param_and_grad_buffer.py L2624-2680) are not modelled",
                                 "estimate with ddp.fp8_param_gather=false"))
    if getattr(optimizer, "optimizer", "adam") != "adam":
        out.append(_not_modelled("optimizer.optimizer", "only Adam's states over Megatron-FSDP's shards are "
                                 "modelled", "estimate with optimizer.optimizer=adam"))
    return out


def bridge_applies(optimizer, ddp) -> list[str]:
    """What Bridge's validation sets with Megatron-FSDP on (training/config.py L1070-1084), written into the copies
    as it does; one note for each that changed."""
    notes = []
    for config in (optimizer, ddp):
        if not getattr(config, "use_distributed_optimizer", False):
            config.use_distributed_optimizer = True
            notes.append(f"{type(config).__name__}.use_distributed_optimizer turned on: Megatron-FSDP always uses "
                         "the distributed optimizer (Bridge training/config.py L1073-1077)")
    ddp.use_megatron_fsdp = True
    if getattr(optimizer, "use_precision_aware_optimizer", False) and \
            not getattr(ddp, "megatron_fsdp_use_decoupled_grad", False):
        ddp.megatron_fsdp_use_decoupled_grad = True
        notes.append("ddp.megatron_fsdp_use_decoupled_grad turned on with the precision-aware optimizer: FusedAdam "
                     "reads the gradient shard as it is, no cast copy (Bridge training/config.py L1079-1084)")
    return notes


SEARCHED = ("optim_grads", "optim_grads_params")
"""The strategies the search proposes: those that shard more than the distributed optimizer does (``optim`` shards
what it shards; ``no_shard`` nothing)."""


def search_options(shape: dict, distributed_optimizer: bool, dp_cp: int) -> list[tuple[Optional[str], bool]]:
    """The (FSDP strategy, bf16 moments) pairs a candidate may take: plain DDP with fp32 or bf16 moments, and each
    :data:`SEARCHED` strategy, all on the distributed optimizer (Core asserts it for the precision-aware optimizer,
    optimizer_config.py L430-436; Bridge turns it on for FSDP); FSDP only where DP x CP > 1 shards something and
    the estimate models it (no FP8: :func:`findings`)."""
    if not distributed_optimizer:
        return [(None, False)]
    strategies = [None] + (list(SEARCHED) if dp_cp > 1 and not shape.get("fp8") else [])
    return [(name, moments) for name in strategies for moments in (False, True)]


DEFAULT_CKPT_FORMAT = "torch_dist"
"""The checkpoint format a config has unless it sets one (Megatron's ``CheckpointConfig.ckpt_format``,
``megatron/training/config/training_config.py`` L486), the one a config leaving Megatron-FSDP goes back to: Bridge
refuses ``fsdp_dtensor`` without Megatron-FSDP when it saves or loads (``training/config.py`` L1389-1394)."""


def strategy_overrides(name: Optional[str], *, from_fsdp: bool = False) -> list[str]:
    """Bridge override strings for Megatron-FSDP with strategy ``name`` (``dist`` and ``ddp`` as Bridge's validation
    sets them, the checkpoint format it saves in), or off (None); ``from_fsdp``: the given config runs Megatron-FSDP,
    so its ``fsdp_dtensor`` checkpoint format goes back to :data:`DEFAULT_CKPT_FORMAT` with it."""
    if name is None:
        back = [f"checkpoint.ckpt_format={DEFAULT_CKPT_FORMAT}"] if from_fsdp else []
        return ["dist.use_megatron_fsdp=false", "ddp.use_megatron_fsdp=false"] + back
    return ["dist.use_megatron_fsdp=true", "ddp.use_megatron_fsdp=true",
            f"ddp.data_parallel_sharding_strategy={name}", "checkpoint.ckpt_format=fsdp_dtensor"]


def moment_overrides(bf16: bool) -> list[str]:
    """The precision-aware optimizer with bf16 moments, or off with Core's fp32 states (it asserts fp32 without it,
    optimizer_config.py L469-481)."""
    dtype = "bf16" if bf16 else "fp32"
    return [f"optimizer.use_precision_aware_optimizer={str(bf16).lower()}", f"optimizer.exp_avg_dtype={dtype}",
            f"optimizer.exp_avg_sq_dtype={dtype}"]


def apply(cfg, name: Optional[str], bf16: bool) -> None:
    """What :func:`strategy_overrides` and :func:`moment_overrides` set, on ``cfg`` in place."""
    import torch

    cfg.dist.use_megatron_fsdp = cfg.ddp.use_megatron_fsdp = name is not None
    if name is not None:
        cfg.ddp.data_parallel_sharding_strategy, cfg.checkpoint.ckpt_format = name, "fsdp_dtensor"
    elif getattr(cfg.checkpoint, "ckpt_format", None) == "fsdp_dtensor":
        cfg.checkpoint.ckpt_format = DEFAULT_CKPT_FORMAT
    cfg.optimizer.use_precision_aware_optimizer = bf16
    cfg.optimizer.exp_avg_dtype = cfg.optimizer.exp_avg_sq_dtype = torch.bfloat16 if bf16 else torch.float32


def given(cfg) -> tuple[Optional[str], bool]:
    """The config's own (FSDP strategy, bf16 moments)."""
    import torch

    optimizer = cfg.optimizer
    moments = bool(getattr(optimizer, "use_precision_aware_optimizer", False)) and \
        getattr(optimizer, "exp_avg_dtype", None) == getattr(optimizer, "exp_avg_sq_dtype", None) == torch.bfloat16
    return (strategy(cfg.ddp) if enabled(cfg.ddp, getattr(cfg, "dist", None)) else None), moments
