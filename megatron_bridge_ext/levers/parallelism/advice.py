"""Parallelism in the plan, each option on the same GPUs (re-estimated): for a mixture-of-experts model EP x 2
first (the dense DP kept), then PP x 2 at the cost of DP, the expert TP x 2 (MoE), then TP x 2 at the cost of DP;
then CPU offloading of layer activations (a formula on the measured per-layer bytes)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_bridge_ext import evidence
from megatron_bridge_ext.estimate import te, te_fp8, trace
from megatron_bridge_ext.estimate.report import gib
from megatron_bridge_ext.findings import ERROR, Finding
from megatron_bridge_ext.levers import optimizer_offload
from megatron_bridge_ext.levers.parallelism import constraints as parallelism, cost as parallelism_cost
from megatron_bridge_ext.levers.step import Cost, Option, State, breakdown, evidence_for, model_errors

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.settings import Settings
    from megatron_bridge_ext.planner import Planner

LAYER_CATEGORIES = (trace.NORMS, trace.ATTENTION, trace.MAMBA, trace.MLP, trace.MOE_DISPATCH, trace.EXPERTS, trace.LORA_INPUTS,
                    te.SHARDS, te_fp8.FP8_SHARDS)
"""Activation categories that live in the transformer layers (what layer offloading moves)."""
EXPERT_NAMES = {"ep": "model.expert_model_parallel_size", "etp": "model.expert_tensor_parallel_size",
                "dp": "data parallel size"}
"""The settings the expert-parallel rules name in an option's constraints."""


@dataclass(frozen=True)
class Resize:
    """One size doubled on the same GPUs: ``halves_dp`` for TP and PP (the dense grid grows), not for EP and ETP
    (the expert grid folds onto the same TP x CP x DP GPUs, only the expert-DP shrinks)."""

    name: str
    field: str
    old: int
    halves_dp: bool
    figure: evidence.Evidence


def resizes(s: Settings, moe: Optional[dict]) -> list[Resize]:
    """The doublings tried, in order: EP (MoE), PP, ETP (MoE), TP. EP first: it keeps the dense DP and the
    microbatches and shards the expert weights, the bulk of an MoE model, with medium traffic on the MoE layers
    alone; Megatron Core's MoE guide prefers EP over TP for the expert layer (:data:`evidence.EP_OVER_TP`).
    ETP before TP: it too keeps the dense DP, and its traffic is on the MoE layers alone."""
    out = []
    if moe:
        out.append(Resize("EP", "expert_model_parallel_size", moe["ep"], False, evidence.EP_OVER_TP))
    out.append(Resize("PP", "pipeline_model_parallel_size", s.pp, True, evidence.PP_DOUBLING))
    if moe:
        out.append(Resize("ETP", "expert_tensor_parallel_size", moe["etp"], False, evidence.EP_OVER_TP))
    out.append(Resize("TP", "tensor_model_parallel_size", s.tp, True, evidence.TP_DOUBLING))
    return out


def resize(planner: Planner, state: State) -> State:
    """Step 4: each of :func:`resizes` on the state before it (alternatives, not stacked); the first that fits ends it."""
    s = state.est.settings
    moe = parallelism_cost.moe_shape(state.cfg.model)
    for r in resizes(s, moe):
        resized = _try(planner, state, r, moe)
        if resized is not None:
            return resized
    return state


def _try(planner: Planner, state: State, r: Resize, moe: Optional[dict]) -> Optional[State]:
    """Record the option of ``r``; the state it leads to when it fits, else None."""
    from megatron_bridge_ext.estimate.memory import NotModelled, parallel_problems

    lever = evidence_for("parallelism")
    s = state.est.settings
    dp = s.dp // 2 if r.halves_dp else s.dp
    cfg = copy.deepcopy(state.cfg)
    setattr(cfg.model, r.field, 2 * r.old)
    overrides = [f"model.{r.field}={2 * r.old}"]
    after = parallelism_cost.moe_shape(cfg.model)
    pinned = r.name == "EP" and after["etp"] != moe["etp"]
    if pinned:  # an unset ETP whose default would drop to 1 with EP > 1, keeping the experts' weights per rank as they are
        cfg.model.expert_tensor_parallel_size = moe["etp"]
        overrides.append(f"model.expert_tensor_parallel_size={moe['etp']}")
        after = parallelism_cost.moe_shape(cfg.model)
    label = _label(r, s, moe, after) + (f" (ETP kept at {moe['etp']})" if pinned else "")
    if r.name == "TP" and moe and not cfg.model.sequence_parallel:  # Core's MoE layer refuses TP > 1 without SP
        cfg.model.sequence_parallel = True
        overrides.append("model.sequence_parallel=true")
        label += ", SP on"
    problems = parallelism.doubling_findings(r.name, r.old, s.dp) if r.halves_dp else []
    problems += expert_findings(r, cfg, s, after) if after else []
    problems += parallel_problems(cfg.model, micro_batch=cfg.train.micro_batch_size, peft=cfg.peft)
    problems += model_errors(cfg)
    cost = Cost(published=str(r.figure), source=r.figure.source)
    if problems:
        planner.add(Option(4, lever["name"], label, False, problems[0].text(), cost=cost, constraints=problems), state)
        return None
    nmb = s.num_microbatches * (2 if r.halves_dp else 1)  # the same global batch on half the replicas
    cfg.data_parallel_size = dp
    element = state.est.element_size()
    try:
        est = planner.estimate(cfg, data_parallel_size=dp, num_microbatches=nmb)
    except NotModelled as refused:
        if not r.halves_dp:  # the layout of the dense part is unchanged: the traffic needs no estimate
            cost.collective_bytes, cost.basis = parallelism_cost.traffic_change(s, s, element, moe, after)
        planner.add(Option(4, lever["name"], label, False, f"no predicted peak: {refused.one_line()}", cost=cost),
                    state)
        return None
    resized = State(cfg, est, dict(state.flags), state.overrides + overrides)
    cost.collective_bytes, cost.basis = parallelism_cost.traffic_change(s, est.settings, element, moe, after)
    return resized if planner.add(Option(4, lever["name"], label, True, cost=cost), resized).fits else None


def _label(r: Resize, s: Settings, moe: Optional[dict], after: Optional[dict]) -> str:
    """The option in a few words: the size doubled, and what else changes (DP, or the expert TP and expert DP)."""
    label = f"{r.name} {r.old} -> {2 * r.old}"
    if r.halves_dp and s.dp % 2:  # refused by doubling_findings: the label says what it would take
        return f"{label}, needs 2x the GPUs (DP {s.dp} cannot be halved)"
    if r.halves_dp:
        return f"{label}, DP {s.dp} -> {s.dp // 2}"
    edp = [parallelism_cost.expert_dp_size(s, ep=m["ep"], etp=m["etp"]) for m in (moe, after)]
    return f"{label}, expert DP {edp[0]} -> {edp[1] or 'none'}"


def expert_findings(r: Resize, cfg, s: Settings, after: dict) -> list[Finding]:
    """Why the expert layout after ``r`` cannot run: Core's EP rules
    (:func:`~megatron_bridge_ext.levers.parallelism.constraints.expert_layout_problem`), an expert TP beyond one
    NVLink node or not dividing the experts' FFN width."""
    model = cfg.model
    problem = parallelism.expert_layout_problem(
        ep=after["ep"], etp=getattr(model, "expert_tensor_parallel_size", None), tp=model.tensor_model_parallel_size,
        cp=model.context_parallel_size or 1, dp=s.dp // 2 if r.halves_dp else s.dp, experts=after["experts"],
        bias=bool(getattr(model, "add_bias_linear", False)), names=EXPERT_NAMES)
    out = [problem] if problem else []
    if r.name == "ETP" and after["etp"] > parallelism.MAX_TP:
        out.append(Finding("tp_beyond_node", ERROR, EXPERT_NAMES["etp"],
                           f"ETP={after['etp']} spans more than one {parallelism.MAX_TP}-GPU NVLink node",
                           f"keep ETP <= {parallelism.MAX_TP}"))
    if after["moe_ffn"] % after["etp"]:
        out.append(Finding("parallel_layout", ERROR, EXPERT_NAMES["etp"],
                           f"ETP={after['etp']} does not divide the experts' FFN width {after['moe_ffn']}",
                           "choose sizes that divide it"))
    return out


RECOMPUTE_OFF = ("model.recompute_granularity=null", "model.recompute_method=null", "model.recompute_num_layers=null",
                 "model.recompute_modules=null")
"""The overrides that turn a config's own recompute off (CPU offloading excludes it)."""


def offload(planner: Planner, state: State) -> State:
    """Step 5: the layers offloaded (:func:`_offload_layers`), and beside them the optimizer offloaded to the CPU on
    the same state (:func:`..optimizer_offload.plan_option`: it does not exclude recompute)."""
    layers = _offload_layers(planner, state)
    optimizer_offload.plan_option(planner, state, 5, evidence_for("CPU offloading")["name"])
    return layers


def _offload_layers(planner: Planner, state: State) -> State:
    """All layers but one offloaded, on the state before recompute (offloading excludes it: the config's own
    recompute is turned off, and the config re-estimated without it)."""
    from megatron_bridge_ext.estimate.memory import NotModelled

    lever = evidence_for("CPU offloading")
    recompute_off = []
    if state.cfg.model.recompute_granularity is not None:
        cfg = copy.deepcopy(state.cfg)
        m = cfg.model
        m.recompute_granularity = m.recompute_method = m.recompute_num_layers = m.recompute_modules = None
        try:
            state = State(cfg, planner.estimate(cfg), dict(state.flags), list(state.overrides))
        except NotModelled as refused:
            planner.add(Option(5, lever["name"], "offload (recompute off)", False,
                               f"no predicted peak: {refused.one_line()}", cost=Cost(published=lever["cost"])), state)
            return state
        recompute_off = list(RECOMPUTE_OFF)
    s = state.est.settings
    layers = s.num_layers
    cfg = copy.deepcopy(state.cfg)
    cfg.model.cpu_offloading, cfg.model.cpu_offloading_num_layers = True, layers - 1
    constraints = model_errors(cfg)
    label = f"offload {layers - 1} of {layers} layers ({'recompute turned off' if recompute_off else 'no recompute'})"
    if constraints:
        planner.add(Option(5, lever["name"], label, False, constraints[0].text(),
                           cost=Cost(published=lever["cost"]), constraints=constraints), state)
        return state
    keep = 2 / s.layers_on_stage  # the layer computing and the one being copied stay on the GPU
    parts = breakdown(state.est)
    on_layers = [k for k in parts if k.removeprefix("activations: ") in LAYER_CATEGORIES]
    offloaded_bytes = sum(int(parts[k] * (1 - keep)) for k in on_layers)
    for k in on_layers:
        parts[k] -= int(parts[k] * (1 - keep))
    transfer = 2 * offloaded_bytes * s.num_microbatches // max(1, round(state.est.in_flight_microbatches))
    cost = Cost(published=lever["cost"], pcie_bytes=transfer, basis=f"formula: {gib(transfer)} to the host and back over PCIe per step; "
                                                "2 layers' activations stay on the GPU")
    offloaded = State(cfg, state.est, dict(state.flags), state.overrides + recompute_off + [
        "model.cpu_offloading=true", f"model.cpu_offloading_num_layers={layers - 1}",
        "model.cpu_offloading_activations=true", "model.cpu_offloading_weights=false"])
    planner.add(Option(5, lever["name"], label, True, cost=cost), offloaded, peak=sum(parts.values()), parts=parts)
    return offloaded
