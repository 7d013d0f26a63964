"""Selective recompute in the plan: the modules that save memory here, cheapest (recomputed FLOPs per byte
saved) first, added one at a time (each re-estimated)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from megatron_bridge_ext import evidence
from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.estimate.report import MemoryEstimate
from megatron_bridge_ext.levers.recompute import cost as recompute_cost
from megatron_bridge_ext.levers.step import Cost, Option, State, blocking, evidence_for, validate

if TYPE_CHECKING:
    from megatron_bridge_ext.planner import Planner

RECOMPUTE_CANDIDATES = ("core_attn", "layernorm", "mlp")
"""The modules the plan tries, in this order before sorting by FLOPs per byte saved."""


def options(planner: Planner, state: State) -> State:
    """Step 3: one option per module set tried; the state carries the modules kept so far."""
    lever = evidence_for("selective recompute")
    s = state.est.settings
    if s["recompute_granularity"] == "full":
        planner.add(Option(3, lever["name"], "selective recompute", False, "the config already recomputes full layers",
                           cost=Cost(published=lever["cost"], source=lever["source"])), state)
        return state
    base = list(s["recompute_modules"]) if s["recompute_granularity"] == "selective" else []
    tried: dict[tuple[str, ...], tuple[Any, MemoryEstimate]] = {}
    start_cfg = state.cfg

    def estimate_with(modules: list[str]) -> tuple[Any, MemoryEstimate]:
        if tuple(modules) not in tried:
            cfg = with_recompute(start_cfg, modules)
            tried[tuple(modules)] = cfg, planner.estimate(cfg)
        return tried[tuple(modules)]

    candidates = []
    for module in RECOMPUTE_CANDIDATES:
        if module in base or (module == "layernorm" and s["transformer_impl"] == "transformer_engine"):
            continue  # TE fuses the norms into the linears: nothing for layernorm recompute to drop
        saved = state.est.peak_bytes - estimate_with(base + [module])[1].peak_bytes
        candidates.append((module, saved, recompute_cost.recompute_flops(s, [module])))
    for module, saved, _ in candidates:
        if saved <= 0:
            planner.add(Option(3, lever["name"], f"recompute {module}", False, "saves nothing here (measured)",
                               cost=Cost(published=lever["cost"], source=lever["source"])), state)
    useful = sorted((c for c in candidates if c[1] > 0), key=lambda c: c[2] / c[1])  # FLOPs per byte, cheapest first
    modules = list(base)
    for module, _, _ in useful:
        trial = modules + [module]
        constraints = [f for f in validate(MemoryConfig(recompute_modules=trial, expandable_segments=False), state.cfg)
                       if f.code != "core_attn_effect"]  # the estimate measures the effect instead
        blocked = blocking(constraints)
        if blocked:
            planner.add(Option(3, lever["name"], f"recompute_modules={trial}", False, blocked,
                               constraints=constraints), state)
            continue
        modules = trial
        cfg, est = estimate_with(modules)
        state = State(cfg, est, {**state.flags, "recompute_modules": list(modules)}, list(state.overrides))
        published = [lever["cost"]] if "mlp" in modules else []
        if "core_attn" in modules and s["attention"] == "fused":
            published.append(str(evidence.CORE_ATTN_FUSED))
        cost = Cost(recomputed_flops=recompute_cost.recompute_flops(state.est.settings, modules[len(base):]),
                    published="; ".join(published), source=lever["source"] if published else "",
                    basis=recompute_cost.BASIS)
        planner.add(Option(3, lever["name"], f"recompute_modules={modules}", True, cost=cost,
                           constraints=constraints), state)
        if planner.done():
            break
    return state


def with_recompute(cfg, modules: list[str]):
    out = copy.deepcopy(cfg)
    MemoryConfig(recompute_modules=list(modules), expandable_segments=False).apply(out)
    return out
