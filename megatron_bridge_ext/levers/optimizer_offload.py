"""Optimizer CPU offload (``optimizer.optimizer_cpu_offload``): what Megatron Core 0.19.2 enforces and what the
estimate does not model with it, one rule each, read by the estimate (:mod:`megatron_bridge_ext.estimate.memory`,
its memory model in :mod:`megatron_bridge_ext.estimate.offload`) and the search
(:mod:`megatron_bridge_ext.search.candidates`), with the overrides that set it.

Core builds a ``HybridDeviceOptimizer`` (``optimizer/__init__.py`` L501-540) that steps ``optimizer_offload_fraction``
of the shard on the CPU; its step time is :func:`megatron_bridge_ext.levers.steptime.host_optimizer_seconds`.
"""

from __future__ import annotations

import copy
from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding

SETTING = "optimizer.optimizer_cpu_offload"
SEARCHED = (0.5, 1.0)
"""The fractions the search proposes: half the shard, the whole of it (Bridge's recipes set none but 0.0, off)."""


def fraction(optimizer) -> Optional[float]:
    """``optimizer_offload_fraction`` when the optimizer is offloaded, else None."""
    if not getattr(optimizer, "optimizer_cpu_offload", False):
        return None
    return float(getattr(optimizer, "optimizer_offload_fraction", 0.0) or 0.0)


def _not_modelled(message: str, fix: str) -> Finding:
    return Finding("unsupported_model", ERROR, SETTING, message, fix)


def findings(optimizer, ddp=None, *, grad_bytes_16: bool) -> list[Finding]:
    """What Core refuses or the estimate does not model with the offload on (one line each); ``ddp``: the DDP config,
    for Megatron-FSDP; ``grad_bytes_16``: the gradient buffer is 16-bit."""
    share = fraction(optimizer)
    if share is None:
        return []
    out = []
    if not 0.0 <= share <= 1.0:
        out.append(Finding("optimizer_config", ERROR, "optimizer.optimizer_offload_fraction",
                           f"{share:g} is not a fraction: the hybrid optimizer moves that share of the elements",
                           "set a value from 0 to 1"))
    if not getattr(optimizer, "decoupled_weight_decay", True):
        out.append(Finding("optimizer_config", ERROR, "optimizer.decoupled_weight_decay",
                           "Core asserts CPU offload only with decoupled weight decay (optimizer/__init__.py L508-510)",
                           "set decoupled_weight_decay=true"))
    if not getattr(optimizer, "use_distributed_optimizer", False):
        out.append(_not_modelled("CPU offload without the distributed optimizer is not modelled: Float16Optimizer "
                                 "re-points the hybrid optimizer's groups after it split them (optimizer.py L1012-1018)",
                                 "estimate with use_distributed_optimizer=true"))
    if getattr(optimizer, "use_precision_aware_optimizer", False) and grad_bytes_16:
        out.append(_not_modelled("CPU offload with the precision-aware optimizer and a 16-bit gradient buffer is not "
                                 "modelled: its fp32 gradient copies (hybrid_optimizer.py L93) outlive zero_grad",
                                 "estimate with grad_reduce_in_fp32=true"))
    if getattr(ddp, "use_megatron_fsdp", False):
        out.append(_not_modelled("CPU offload over Megatron-FSDP's DTensor shards is not modelled",
                                 "estimate with optimizer.optimizer_cpu_offload=false"))
    return out


def searchable(optimizer, ddp) -> bool:
    """Whether the search may offload this config's optimizer: Adam (the estimate's Muon refuses it,
    :func:`.estimate.muon.findings`; SGD has no moments worth moving) and no rule of :func:`findings` broken with the
    offload on the distributed optimizer, off the precision-aware one and Megatron-FSDP (the offloaded moments are
    fp32 whatever their dtype says: bf16 moments buy nothing there)."""
    if getattr(optimizer, "optimizer", "adam") != "adam":
        return False
    trial = copy.copy(optimizer)
    trial.optimizer_cpu_offload, trial.optimizer_offload_fraction = True, SEARCHED[-1]
    trial.use_distributed_optimizer, trial.use_precision_aware_optimizer = True, False
    return not findings(trial, grad_bytes_16=False)


def search_options(allowed: bool, *, distributed_optimizer: bool, fsdp: Optional[str],
                   bf16_moments: bool) -> list[Optional[float]]:
    """The offload fractions a candidate may take: none, and :data:`SEARCHED` where :func:`searchable` allowed it
    and the candidate runs the distributed optimizer without Megatron-FSDP or bf16 moments."""
    if allowed and distributed_optimizer and fsdp is None and not bf16_moments:
        return [None, *SEARCHED]
    return [None]


def overrides(share: Optional[float], overlap: bool) -> list[str]:
    """Bridge override strings for the optimizer offloaded at ``share`` (None: off), its copies overlapped or not."""
    if share is None:
        return ["optimizer.optimizer_cpu_offload=false"]
    return ["optimizer.optimizer_cpu_offload=true", f"optimizer.optimizer_offload_fraction={share:g}",
            f"optimizer.overlap_cpu_optimizer_d2h_h2d={str(overlap).lower()}"]


def apply(optimizer, share: Optional[float], overlap: bool) -> None:
    """What :func:`overrides` sets, on ``optimizer`` in place."""
    optimizer.optimizer_cpu_offload = share is not None
    if share is not None:
        optimizer.optimizer_offload_fraction, optimizer.overlap_cpu_optimizer_d2h_h2d = share, overlap


def given(optimizer) -> tuple[Optional[float], bool]:
    """The config's own (fraction, overlap); (None, False) with the offload off."""
    share = fraction(optimizer)
    return share, share is not None and bool(getattr(optimizer, "overlap_cpu_optimizer_d2h_h2d", False))


PLANNED = SEARCHED[-1]
"""The share the plain plan offloads: the whole shard (the most it saves; its step-time cost is priced)."""


def plan_option(planner, state, step: int, lever: str):
    """The plan's offloading step's option of the optimizer offloaded (:data:`PLANNED`, overlapped copies) on
    ``state``: estimated, or not applicable with the rule it breaks or the estimate's refusal."""
    from megatron_bridge_ext.estimate.memory import NotModelled
    from megatron_bridge_ext.levers.step import Cost, Option, State

    cfg = copy.deepcopy(state.cfg)
    apply(cfg.optimizer, PLANNED, True)
    label = f"optimizer CPU offload (fraction {PLANNED:g}, overlap)"
    problems = [] if getattr(cfg.optimizer, "optimizer", "adam") == "adam" else [
        Finding("unsupported_model", ERROR, "optimizer.optimizer", "the plan offloads Adam's states only",
                "offload with optimizer.optimizer=adam")]
    grad_16 = not getattr(cfg.ddp, "grad_reduce_in_fp32", False) and state.est.settings.dtype != "float32"
    problems += findings(cfg.optimizer, cfg.ddp, grad_bytes_16=grad_16)
    if problems:
        return planner.add(Option(step, lever, label, False, problems[0].text(), constraints=problems), state)
    try:
        est = planner.estimate(cfg)
    except NotModelled as refused:
        return planner.add(Option(step, lever, label, False, f"no predicted peak: {refused.one_line()}"), state)
    cost = Cost(basis="formula: the host's Adam on the offloaded shard at the host's memory bandwidth, its fp32 "
                      "gradients down and parameters up over the host link, pipelined with the GPU's share")
    return planner.add(Option(step, lever, label, True, cost=cost),
                       State(cfg, est, dict(state.flags), state.overrides + overrides(PLANNED, True)))
