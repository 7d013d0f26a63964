"""The OOM decision procedure, before launch: does a config fit, and which lever is enough if not.

``plan(cfg, gpu_memory=...)`` estimates the config's per-rank peak (:mod:`.estimate`), puts
Bridge's own estimate beside it, and, when the peak does not fit the device with a margin for
what the estimate does not model, walks the levers of :data:`megatron_bridge_ext.evidence.LEVERS`
in their order, each applied on top of the ones before:

1. allocator: expandable segments shrink the fragmentation margin (no memory saved, no cost);
2. LoRA-A input under sequence parallelism: ``shard_local`` (re-estimated);
3. selective recompute: the modules that save memory here, cheapest (recomputed FLOPs per byte
   saved) first, added one at a time (each re-estimated);
4. parallelism: PP x 2, then TP x 2, at the cost of DP (re-estimated);
5. CPU offloading of layer activations (a formula on the measured per-layer bytes).

Each option carries its predicted peak, its cost (collective bytes per step, recomputed FLOPs per
step, the published throughput figure where one exists) and its constraints, which come from
``MemoryConfig.validate`` (the checks a user gets when applying the flags). The first option that
fits is the answer, as a :class:`MemoryConfig` and as override strings that Bridge's own override
parser turns into the same config (the PEFT change only where overrides built the PEFT; otherwise a
note says why not and gives the ``MemoryConfig(...).apply(cfg)`` line).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_bridge_ext import evidence
from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.estimate.bridge import BridgeEstimate
from megatron_bridge_ext.estimate.report import ACTIVATIONS, BUFFERS, STATIC, MemoryEstimate, gib
from megatron_bridge_ext.findings import ERROR, NO_EFFECT, Finding, Refused
from megatron_bridge_ext.levers.lora_input import cost as lora_input_cost
from megatron_bridge_ext.levers.parallelism import constraints as parallelism, cost as parallelism_cost
from megatron_bridge_ext.levers.recompute import cost as recompute_cost
from megatron_bridge_ext.overrides import PEFT_OBJECT_REASON

MARGIN = 0.10
"""Share of device memory kept free without expandable segments: a caching allocator that fragments
can hold this much reserved but unusable (``mbx diagnose`` calls an OOM fragmentation from 10% of
reserved memory), and the estimate leaves out NCCL buffers, the CUDA context and kernel workspaces."""
EXPANDABLE_MARGIN = 0.03
"""Share kept free with expandable segments: no split segments, only block rounding and what the
estimate leaves out."""

RECOMPUTE_CANDIDATES = ("core_attn", "layernorm", "mlp")
LAYER_CATEGORIES = ("norms", "attention", "mlp", "lora inputs", "TE norm-output shards (contract)")
"""Activation categories that live in the transformer layers (what layer offloading moves)."""


def _lever(name: str) -> dict:
    for lever in evidence.LEVERS:
        if lever["name"] == name:
            return lever
    raise KeyError(name)


@dataclass
class Cost:
    """What an option costs per training step on one rank."""

    collective_bytes: Optional[int] = None
    """Change in bytes this rank moves per step (negative: fewer), with the formula in ``basis``."""
    recomputed_flops: Optional[int] = None
    published: str = ""
    source: str = ""
    basis: str = ""

    def measured(self) -> str:
        """The computed costs in a few words (the published figure is listed apart, with its source)."""
        parts = []
        if self.collective_bytes is not None:
            sign = "+" if self.collective_bytes >= 0 else "-"
            parts.append(f"collectives {sign}{gib(abs(self.collective_bytes))}/step")
        if self.recomputed_flops:
            parts.append(f"recompute +{self.recomputed_flops / 1e12:,.2f} TFLOP/step")
        return "; ".join(parts) or ("see published figure" if self.published else "none")


@dataclass
class Option:
    """One step of the procedure: what it sets, the predicted peak after it, its cost and constraints.

    ``label`` names the option in a few words; ``reason`` says why it does not apply (empty when it does).
    """

    step: int
    lever: str
    label: str
    applicable: bool
    reason: str = ""
    peak_bytes: Optional[int] = None
    usable_bytes: Optional[int] = None
    breakdown: dict[str, int] = field(default_factory=dict)
    cost: Cost = field(default_factory=Cost)
    constraints: list[Finding] = field(default_factory=list)
    flags: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    peft_note: str = ""
    """Set when the PEFT change is not in ``overrides``: why, and the Python line that makes it."""
    config: Any = field(default=None, repr=False, compare=False)
    """The config this option leads to, as the estimate saw it (not serialised)."""

    @property
    def fits(self) -> bool:
        return self.applicable and self.peak_bytes is not None and self.peak_bytes <= self.usable_bytes

    def as_dict(self) -> dict:
        return {"step": self.step, "lever": self.lever, "label": self.label, "applicable": self.applicable,
                "reason": self.reason, "peak_bytes": self.peak_bytes, "usable_bytes": self.usable_bytes, "fits": self.fits,
                "breakdown": self.breakdown, "cost": vars(self.cost), "constraints": [c.to_dict() for c in self.constraints],
                "memory_config": self.flags, "overrides": self.overrides, "peft_note": self.peft_note}


@dataclass
class Plan:
    """The estimate as the config stands, Bridge's beside it, and the options tried in order."""

    gpu_memory: int
    margin: float
    expandable_margin: float
    expandable_segments: bool
    baseline: MemoryEstimate
    bridge: Optional[BridgeEstimate]
    options: list[Option]
    notes: list[str] = field(default_factory=list)
    """How the config's builder decided settings the user left to it (printed with the config)."""

    @property
    def usable_now(self) -> int:
        return _usable(self.gpu_memory, self.expandable_margin if self.expandable_segments else self.margin)

    @property
    def fits_as_is(self) -> bool:
        return self.baseline.peak_bytes <= self.usable_now

    @property
    def chosen(self) -> Optional[Option]:
        """The answer: the first option that fits (``answer`` in the text and the JSON)."""
        return next((o for o in self.options if o.fits), None)

    def memory_config(self) -> Optional[MemoryConfig]:
        chosen = self.chosen
        return MemoryConfig(**chosen.flags) if chosen else None

    def overrides(self) -> list[str]:
        chosen = self.chosen
        return list(chosen.overrides) if chosen else []

    def as_dict(self) -> dict:
        chosen = self.chosen
        return {"gpu_memory": self.gpu_memory, "margin": self.margin, "expandable_margin": self.expandable_margin,
                "expandable_segments": self.expandable_segments, "usable_now": self.usable_now,
                "fits_as_is": self.fits_as_is, "estimate": self.baseline.as_dict(),
                "bridge_estimate": self.bridge.as_dict() if self.bridge else None,
                "options": [o.as_dict() for o in self.options], "notes": self.notes,
                "answer": None if chosen is None else {"step": chosen.step, "label": chosen.label,
                                                       "memory_config": chosen.flags, "overrides": chosen.overrides,
                                                       "peft_note": chosen.peft_note}}


def _usable(gpu_memory: int, margin: float) -> int:
    return int(gpu_memory * (1 - margin))


def breakdown(est: MemoryEstimate) -> dict[str, int]:
    """Where the peak goes, for tables and plots: weights, gradients and optimizer, each activation
    category, buffers and the largest transient. The values sum to ``est.peak_bytes``."""
    static = [c for c in est.components if c.kind == STATIC]
    parts = {"weights": sum(c.bytes for c in static if c.name.startswith("weights")),
             "gradients and optimizer": sum(c.bytes for c in static if not c.name.startswith("weights"))}
    parts.update({f"activations: {c.name}": c.bytes for c in est.components if c.kind == ACTIVATIONS})
    largest = est.largest_transient
    parts.update({"buffers": est.total(BUFFERS), "transient": largest.bytes if largest else 0})
    return parts


# --------------------------------------------------------------------------------------------- planner

@dataclass
class _State:
    """The config with the levers applied so far, its estimate, and the flags that got it there."""

    cfg: Any
    est: MemoryEstimate
    flags: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    def copy(self) -> "_State":
        return _State(self.cfg, self.est, dict(self.flags), list(self.overrides))


class _Planner:
    def __init__(self, *, gpu_memory: int, margin: float, expandable_margin: float, expandable_segments: bool,
                 estimate_options: dict, cfg, peft_overrides: Optional[list[str]]):
        self.gpu_memory, self.margin, self.expandable_margin = gpu_memory, margin, expandable_margin
        self.expandable = expandable_segments
        self.estimate_options = estimate_options
        self.cfg, self.peft_overrides = cfg, peft_overrides
        self.options: list[Option] = []

    def estimate(self, cfg, **overrides) -> MemoryEstimate:
        from megatron_bridge_ext.estimate import estimate

        return estimate(cfg, **{**self.estimate_options, **overrides})

    def usable(self) -> int:
        return _usable(self.gpu_memory, self.expandable_margin if self.expandable else self.margin)

    def add(self, option: Option, state: _State, *, peak: Optional[int] = None,
            parts: Optional[dict[str, int]] = None) -> Option:
        """Record ``option`` as reached from ``state`` (its flags, overrides and, when applicable, its estimate)."""
        option.usable_bytes = self.usable()
        option.flags = dict(state.flags)
        option.config = state.cfg
        flags = MemoryConfig(**state.flags) if state.flags else None
        option.overrides = (flags.overrides(self.cfg, peft_overrides=self.peft_overrides) if flags else []) \
            + list(state.overrides)
        if flags and flags.peft_needs_python(self.cfg, peft_overrides=self.peft_overrides):
            option.peft_note = (f"peft: overrides cannot change this cfg.peft ({PEFT_OBJECT_REASON}); in the training "
                                f"script: {_python_line(state.flags)}")
        if option.applicable:
            option.peak_bytes = state.est.peak_bytes if peak is None else peak
            option.breakdown = breakdown(state.est) if parts is None else parts
        self.options.append(option)
        return option

    def done(self) -> bool:
        return any(o.fits for o in self.options)


def plan(cfg, *, gpu_memory: int, margin: float = MARGIN, expandable_margin: float = EXPANDABLE_MARGIN,
         expandable_segments: Optional[bool] = None, estimate_options: Optional[dict] = None,
         with_bridge: bool = True, peft_overrides: Optional[list[str]] = None) -> Plan:
    """Estimate ``cfg`` and, if it does not fit ``gpu_memory`` bytes per GPU, walk the levers until one fits.

    ``expandable_segments``: whether the run already has them (default: from ``cfg.env_vars``).
    ``estimate_options`` are passed to :func:`megatron_bridge_ext.estimate.estimate`.
    ``peft_overrides``: how overrides built ``cfg.peft`` on a recipe without one
    (:attr:`megatron_bridge_ext.estimate.configs.Built.peft_overrides`); None, the default, for a
    ``cfg.peft`` set in Python, whose changes the answer gives as a Python line instead of overrides.
    """
    from megatron_bridge_ext.estimate.bridge import bridge_estimate

    if gpu_memory <= 0:
        raise Refused("plan", [Finding("bad_input", ERROR, "gpu_memory", f"is {gpu_memory}",
                                       "give the device's memory in bytes, e.g. 80 * 2**30 for 80 GiB")])
    if expandable_segments is None:
        expandable_segments = _expandable_in(cfg)
    planner = _Planner(gpu_memory=gpu_memory, margin=margin, expandable_margin=expandable_margin,
                       expandable_segments=expandable_segments, estimate_options=dict(estimate_options or {}),
                       cfg=cfg, peft_overrides=peft_overrides)
    baseline = planner.estimate(cfg)
    # Every later estimate keeps the baseline's DP and microbatches unless a lever changes them.
    planner.estimate_options.update(data_parallel_size=baseline.settings["dp"],
                                    num_microbatches=baseline.settings["num_microbatches"])
    bridge = bridge_estimate(cfg, data_parallel_size=baseline.settings["dp"],
                             num_microbatches=baseline.settings["num_microbatches"]) if with_bridge else None
    result = Plan(gpu_memory, margin, expandable_margin, expandable_segments, baseline, bridge, planner.options)
    if result.fits_as_is:
        return result
    state = _State(copy.deepcopy(cfg), baseline)
    before_recompute = None
    for step in (_allocator, _lora_input, _recompute, _parallelism, _offloading):
        if step is _recompute:
            before_recompute = state.copy()
        if step is _offloading:
            state = before_recompute  # offloading excludes recompute: it replaces step 3, on top of steps 1-2
        state = step(planner, state)
        if planner.done():
            break
    return result


def _python_line(flags: dict) -> str:
    return "MemoryConfig(" + ", ".join(f"{k}={v!r}" for k, v in flags.items()) + ").apply(cfg)"


def _expandable_in(cfg) -> bool:
    from megatron_bridge_ext.levers.allocator.options import effective, parse_version
    from megatron_bridge_ext.levers.allocator.env_plan import installed_torch_version

    env = {k: str(v) for k, v in (getattr(cfg, "env_vars", None) or {}).items()}
    _, conf = effective(env, parse_version(installed_torch_version()))
    return bool(conf.flag("expandable_segments"))


def _validate(flags: MemoryConfig, cfg) -> list[Finding]:
    try:
        return flags.validate(cfg)
    except Refused as refused:
        return refused.findings


def _blocking(findings: list[Finding]) -> Optional[str]:
    for f in findings:
        if f.level in (ERROR, NO_EFFECT):
            return f.text()
    return None


def _allocator(planner: _Planner, state: _State) -> _State:
    lever = _lever("allocator")
    constraints = _validate(MemoryConfig(expandable_segments=True), state.cfg)
    cost = Cost(published=lever["cost"], source=lever["source"])
    if planner.expandable:
        state.flags["expandable_segments"] = True
        planner.add(Option(1, lever["name"], "expandable segments", False, "already on", cost=cost,
                           constraints=constraints), state)
        return state
    blocked = _blocking(constraints)
    planner.expandable = blocked is None
    state.flags["expandable_segments"] = blocked is None
    planner.add(Option(1, lever["name"], "expandable segments", blocked is None, blocked or "", cost=cost,
                       constraints=constraints), state)
    return state


def _lora_input(planner: _Planner, state: _State) -> _State:
    lever = _lever("LoRA input under sequence parallelism")
    flags = MemoryConfig(lora_sp_input="shard_local", expandable_segments=False)
    constraints = _validate(flags, state.cfg)
    current = state.est.settings.get("lora_sp_input")
    published = f"no published figure; upstream's regather for comparison: {evidence.QWEN3_8B_REGATHER}"
    blocked = "already shard_local" if current == "shard_local" else _blocking(constraints)
    if blocked:
        planner.add(Option(2, lever["name"], "lora_sp_input=shard_local", False, blocked,
                           cost=Cost(published=published), constraints=constraints), state)
        return state
    cfg = copy.deepcopy(state.cfg)
    flags.apply(cfg)
    change, basis = lora_input_cost.collective_change(state.est, "shard_local")
    new = _State(cfg, planner.estimate(cfg), {**state.flags, "lora_sp_input": "shard_local"}, list(state.overrides))
    planner.add(Option(2, lever["name"], "lora_sp_input=shard_local", True, constraints=constraints,
                       cost=Cost(collective_bytes=change, published=published, basis=basis)), new)
    return new


def _recompute(planner: _Planner, state: _State) -> _State:
    lever = _lever("selective recompute")
    s = state.est.settings
    if s["recompute_granularity"] == "full":
        planner.add(Option(3, lever["name"], "selective recompute", False,
                           "the config already recomputes full layers", cost=Cost(published=lever["cost"], source=lever["source"])), state)
        return state
    base = list(s["recompute_modules"]) if s["recompute_granularity"] == "selective" else []
    tried: dict[tuple[str, ...], tuple[Any, MemoryEstimate]] = {}
    start_cfg = state.cfg

    def estimate_with(modules: list[str]) -> tuple[Any, MemoryEstimate]:
        if tuple(modules) not in tried:
            cfg = _with_recompute(start_cfg, modules)
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
        constraints = [f for f in _validate(MemoryConfig(recompute_modules=trial, expandable_segments=False), state.cfg)
                       if f.code != "core_attn_effect"]  # the estimate measures the effect instead
        blocked = _blocking(constraints)
        if blocked:
            planner.add(Option(3, lever["name"], f"recompute_modules={trial}", False, blocked,
                               constraints=constraints), state)
            continue
        modules = trial
        cfg, est = estimate_with(modules)
        state = _State(cfg, est, {**state.flags, "recompute_modules": list(modules)}, list(state.overrides))
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


def _with_recompute(cfg, modules: list[str]):
    out = copy.deepcopy(cfg)
    MemoryConfig(recompute_modules=list(modules), expandable_segments=False).apply(out)
    return out


def _parallelism(planner: _Planner, state: _State) -> _State:
    from megatron_bridge_ext.estimate.memory import parallel_problems

    lever = _lever("parallelism")
    s = state.est.settings
    for name, field_name, figure in (("PP", "pipeline_model_parallel_size", evidence.PP_DOUBLING),
                                     ("TP", "tensor_model_parallel_size", evidence.TP_DOUBLING)):
        old = s[name.lower()]
        label = f"{name} {old} -> {2 * old}, DP {s['dp']} -> {max(s['dp'] // 2, 1)}"
        cfg = copy.deepcopy(state.cfg)
        setattr(cfg.model, field_name, 2 * old)
        problems = parallelism.doubling_findings(name, old, s["dp"])
        problems += parallel_problems(cfg.model, micro_batch=cfg.train.micro_batch_size, peft=cfg.peft)
        problems += _model_errors(cfg)
        cost = Cost(published=str(figure), source=lever["source"])
        if problems:
            planner.add(Option(4, lever["name"], label, False, problems[0].text(), cost=cost,
                               constraints=problems), state)
            continue
        dp, nmb = s["dp"] // 2, s["num_microbatches"] * 2  # the same global batch on half the replicas
        cfg.data_parallel_size = dp
        resized = _State(cfg, planner.estimate(cfg, data_parallel_size=dp, num_microbatches=nmb), dict(state.flags),
                         state.overrides + [f"model.{field_name}={2 * old}"])
        cost.collective_bytes, cost.basis = parallelism_cost.traffic_change(state.est.settings, resized.est.settings,
                                                                            state.est.element_size())
        if planner.add(Option(4, lever["name"], label, True, cost=cost), resized).fits:
            return resized
    return state


def _model_errors(cfg) -> list[Finding]:
    """The model-level refusals ``MemoryConfig.validate`` makes (offloading, recompute, CUDA graphs)."""
    return [f for f in _validate(MemoryConfig(expandable_segments=False), cfg) if f.level == ERROR]


def _offloading(planner: _Planner, state: _State) -> _State:
    lever = _lever("CPU offloading")
    s = state.est.settings
    layers = s["num_layers"]
    cfg = copy.deepcopy(state.cfg)
    cfg.model.cpu_offloading, cfg.model.cpu_offloading_num_layers = True, layers - 1
    constraints = _model_errors(cfg)
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
    cost = Cost(published=lever["cost"], basis=f"formula: {gib(transfer)} to the host and back over PCIe per step; "
                                                "2 layers' activations stay on the GPU")
    offloaded = _State(cfg, state.est, dict(state.flags), state.overrides + [
        "model.cpu_offloading=true", f"model.cpu_offloading_num_layers={layers - 1}",
        "model.cpu_offloading_activations=true", "model.cpu_offloading_weights=false"])
    planner.add(Option(5, lever["name"], label, True, cost=cost), offloaded, peak=sum(parts.values()), parts=parts)
    return offloaded
