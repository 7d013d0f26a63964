"""Parallelism in the plan: PP x 2, then TP x 2, at the cost of DP (re-estimated); then CPU offloading of
layer activations (a formula on the measured per-layer bytes)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from megatron_bridge_ext import evidence
from megatron_bridge_ext.estimate.report import gib
from megatron_bridge_ext.levers.parallelism import constraints as parallelism, cost as parallelism_cost
from megatron_bridge_ext.levers.step import Cost, Option, State, breakdown, evidence_for, model_errors

if TYPE_CHECKING:
    from megatron_bridge_ext.planner import Planner

LAYER_CATEGORIES = ("norms", "attention", "mlp", "lora inputs", "TE norm-output shards (contract)")
"""Activation categories that live in the transformer layers (what layer offloading moves)."""


def resize(planner: Planner, state: State) -> State:
    """Step 4: PP x 2, then TP x 2, each on the same GPUs (DP halves, twice the microbatches per step)."""
    from megatron_bridge_ext.estimate.memory import parallel_problems

    lever = evidence_for("parallelism")
    s = state.est.settings
    for name, field_name, figure in (("PP", "pipeline_model_parallel_size", evidence.PP_DOUBLING),
                                     ("TP", "tensor_model_parallel_size", evidence.TP_DOUBLING)):
        old = s[name.lower()]
        label = f"{name} {old} -> {2 * old}, DP {s['dp']} -> {max(s['dp'] // 2, 1)}"
        cfg = copy.deepcopy(state.cfg)
        setattr(cfg.model, field_name, 2 * old)
        problems = parallelism.doubling_findings(name, old, s["dp"])
        problems += parallel_problems(cfg.model, micro_batch=cfg.train.micro_batch_size, peft=cfg.peft)
        problems += model_errors(cfg)
        cost = Cost(published=str(figure), source=lever["source"])
        if problems:
            planner.add(Option(4, lever["name"], label, False, problems[0].text(), cost=cost,
                               constraints=problems), state)
            continue
        dp, nmb = s["dp"] // 2, s["num_microbatches"] * 2  # the same global batch on half the replicas
        cfg.data_parallel_size = dp
        resized = State(cfg, planner.estimate(cfg, data_parallel_size=dp, num_microbatches=nmb), dict(state.flags),
                        state.overrides + [f"model.{field_name}={2 * old}"])
        cost.collective_bytes, cost.basis = parallelism_cost.traffic_change(state.est.settings, resized.est.settings,
                                                                            state.est.element_size())
        if planner.add(Option(4, lever["name"], label, True, cost=cost), resized).fits:
            return resized
    return state


def offload(planner: Planner, state: State) -> State:
    """Step 5: all layers but one offloaded, on the state before recompute (offloading excludes it)."""
    lever = evidence_for("CPU offloading")
    s = state.est.settings
    layers = s["num_layers"]
    cfg = copy.deepcopy(state.cfg)
    cfg.model.cpu_offloading, cfg.model.cpu_offloading_num_layers = True, layers - 1
    constraints = model_errors(cfg)
    label = f"offload {layers - 1} of {layers} layers (no recompute)"
    if constraints:
        planner.add(Option(5, lever["name"], label, False, constraints[0].text(),
                           cost=Cost(published=lever["cost"]), constraints=constraints), state)
        return state
    keep = 2 / s["layers_on_stage"]  # the layer computing and the one being copied stay on the GPU
    parts = breakdown(state.est)
    on_layers = [k for k in parts if k.removeprefix("activations: ") in LAYER_CATEGORIES]
    offloaded_bytes = sum(int(parts[k] * (1 - keep)) for k in on_layers)
    for k in on_layers:
        parts[k] -= int(parts[k] * (1 - keep))
    transfer = 2 * offloaded_bytes * s["num_microbatches"] // max(1, round(state.est.in_flight_microbatches))
    cost = Cost(published=lever["cost"], pcie_bytes=transfer, basis=f"formula: {gib(transfer)} to the host and back over PCIe per step; "
                                                "2 layers' activations stay on the GPU")
    offloaded = State(cfg, state.est, dict(state.flags), state.overrides + [
        "model.cpu_offloading=true", f"model.cpu_offloading_num_layers={layers - 1}",
        "model.cpu_offloading_activations=true", "model.cpu_offloading_weights=false"])
    planner.add(Option(5, lever["name"], label, True, cost=cost), offloaded, peak=sum(parts.values()), parts=parts)
    return offloaded
