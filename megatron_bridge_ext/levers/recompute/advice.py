"""Selective recompute in the plan: the modules that save memory here (the MoE modules too on a mixture-of-experts
model), cheapest (recomputed FLOPs per byte saved) first, added one at a time (each re-estimated)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional

from megatron_bridge_ext import evidence
from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.estimate.report import MemoryEstimate
from megatron_bridge_ext.levers.parallelism.cost import moe_shape, stage_layer_kinds
from megatron_bridge_ext.levers.recompute import cost as recompute_cost
from megatron_bridge_ext.levers.step import Cost, Option, State, blocking, evidence_for, validate

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.settings import Settings
    from megatron_bridge_ext.planner import Planner

RECOMPUTE_CANDIDATES = ("core_attn", "layernorm", "mlp")
"""The modules the plan tries on every model, in this order before sorting by FLOPs per byte saved."""
MOE_CANDIDATES = ("moe_act", "moe", "shared_experts")
"""The modules it adds for a mixture-of-experts model (``shared_experts`` only where the model has them)."""
MLA_CANDIDATES = ("mla_up_proj",)
"""The module it adds for a multi-latent attention model: its up projections and RoPE (Core's ``MLASelfAttention``)."""
INSIDE_MOE = ("moe_act", "shared_experts")
"""Modules that ``moe`` recompute already covers: it checkpoints the whole MoE layer, these included."""


def candidates_for(s: Settings, moe: Optional[dict]) -> list[str]:
    """The modules worth measuring on this stage: layernorm not under Transformer Engine without MoE layers (TE
    fuses the norms into the linears; an MoE layer's norm before the router stays apart), mlp where there are dense
    layers, mla_up_proj where the model has multi-latent attention, the MoE modules where there are MoE layers
    (shared_experts where the model has them)."""
    dense, moe_layers = stage_layer_kinds(s, moe)
    out = [m for m in RECOMPUTE_CANDIDATES
           if not (m == "layernorm" and s.transformer_impl == "transformer_engine" and not moe_layers)
           and not (m == "mlp" and not dense)]
    if s.mla is not None:
        out += list(MLA_CANDIDATES)
    if moe_layers:
        out += [m for m in MOE_CANDIDATES if m != "shared_experts" or moe["shared_ffn"]]
    return out


def options(planner: Planner, state: State) -> State:
    """Step 3: one option per module set tried; the state carries the modules kept so far."""
    lever = evidence_for("selective recompute")
    s = state.est.settings
    if s.recompute_granularity == "full":
        planner.add(Option(3, lever["name"], "selective recompute", False, "the config already recomputes full layers",
                           cost=Cost(published=lever["cost"], source=lever["source"])), state)
        return state
    base = list(s.recompute_modules) if s.recompute_granularity == "selective" else []
    moe = moe_shape(state.cfg.model)
    tried: dict[tuple[str, ...], tuple[Any, MemoryEstimate]] = {}
    start_cfg = state.cfg

    def estimate_with(modules: list[str]) -> tuple[Any, MemoryEstimate]:
        if tuple(modules) not in tried:
            cfg = with_recompute(start_cfg, modules)
            tried[tuple(modules)] = cfg, planner.estimate(cfg)
        return tried[tuple(modules)]

    candidates = []
    for module in candidates_for(s, moe):
        if module in base:
            continue
        blocked, constraints = _blocked(state.cfg, base + [module])
        if blocked:  # refused before it is estimated: Megatron Core would refuse the model
            planner.add(Option(3, lever["name"], f"recompute {module}", False, blocked, constraints=constraints), state)
            continue
        saved = state.est.peak_bytes - estimate_with(base + [module])[1].peak_bytes
        candidates.append((module, saved, recompute_cost.recompute_flops(s, [module], moe)))
    for module, saved, _ in candidates:
        if saved <= 0:
            planner.add(Option(3, lever["name"], f"recompute {module}", False, "saves nothing here (measured)",
                               cost=Cost(published=lever["cost"], source=lever["source"])), state)
    useful = sorted((c for c in candidates if c[1] > 0), key=lambda c: c[2] / c[1])  # FLOPs per byte, cheapest first
    modules = list(base)
    for module, _, _ in useful:
        trial = modules + [module]
        if "moe" in modules and module in INSIDE_MOE:
            planner.add(Option(3, lever["name"], f"recompute_modules={trial}", False,
                               f"'moe' recompute already recomputes {module} (the whole MoE layer)"), state)
            continue
        blocked, constraints = _blocked(state.cfg, trial)
        if blocked:
            planner.add(Option(3, lever["name"], f"recompute_modules={trial}", False, blocked,
                               constraints=constraints), state)
            continue
        modules = trial
        cfg, est = estimate_with(modules)
        state = State(cfg, est, {**state.flags, "recompute_modules": list(modules)}, list(state.overrides))
        planner.add(Option(3, lever["name"], f"recompute_modules={modules}", True,
                           cost=_cost(lever, s, state.est, modules[len(base):], moe), constraints=constraints), state)
        if planner.done():
            break
    return state


def _blocked(cfg, modules: list[str]):
    """The first refusal of recomputing ``modules`` on ``cfg`` (None when allowed), and every finding."""
    constraints = [f for f in validate(MemoryConfig(recompute_modules=modules, expandable_segments=False), cfg)
                   if f.code != "core_attn_effect"]  # the estimate measures the effect instead
    return blocking(constraints), constraints


def _cost(lever: dict, s: Settings, est: MemoryEstimate, added: list[str], moe: Optional[dict]) -> Cost:
    """The recomputed FLOPs of the modules ``added`` per step (and the dispatch ``moe`` repeats), with the published
    figures that apply."""
    modules = est.settings.recompute_modules
    published = [lever["cost"]] if "mlp" in modules else []
    if "core_attn" in modules and s.attention == "fused":
        published.append(str(evidence.CORE_ATTN_FUSED))
    repeated = recompute_cost.recompute_dispatch_bytes(est.settings, added, moe, est.element_size())
    return Cost(collective_bytes=repeated or None,
                recomputed_flops=recompute_cost.recompute_flops(est.settings, added, moe),
                published="; ".join(published), source=lever["source"] if published else "",
                basis=recompute_cost.MOE_BASIS if moe else recompute_cost.BASIS)


def with_recompute(cfg, modules: list[str]):
    out = copy.deepcopy(cfg)
    MemoryConfig(recompute_modules=list(modules), expandable_segments=False).apply(out)
    return out
