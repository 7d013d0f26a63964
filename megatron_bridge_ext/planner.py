"""The OOM decision procedure, before launch: does a config fit, and which lever is enough if not.

``plan(cfg, gpu_memory=...)`` estimates the config's per-rank peak (:mod:`.estimate`), puts
Bridge's own estimate beside it, and, when the peak does not fit the device with a margin for
what the estimate does not model, walks the levers of :data:`megatron_bridge_ext.evidence.LEVERS`
in their order, each applied on top of the ones before:

1. allocator: expandable segments shrink the fragmentation margin (no memory saved, no cost);
2. LoRA-A input under sequence parallelism: ``shard_local`` (re-estimated);
3. selective recompute: the modules that save memory here (``moe_act``, ``moe`` and ``shared_experts`` too on
   a mixture-of-experts model), cheapest (recomputed FLOPs per byte saved) first, added one at a time (each
   re-estimated);
4. parallelism (re-estimated): on a mixture-of-experts model EP x 2 first (the same GPUs, the dense DP kept),
   PP x 2 at the cost of DP, the expert TP x 2 (MoE), then TP x 2 at the cost of DP;
5. CPU offloading of layer activations (a formula on the measured per-layer bytes).

Each step is its lever's ``advice`` module (``megatron_bridge_ext/levers/<lever>/advice.py``): the
options it offers, their cost (the lever's ``cost`` module) and constraints; this module loops over
them (:data:`STEPS`) and records each option through :class:`Planner`.

Each option carries its predicted peak, its cost (collective bytes per step, recomputed FLOPs per
step, the predicted step-time change of a calibrated model (:mod:`.levers.steptime`) against the config
as is, the published throughput figure where one exists) and its constraints, which come from
``MemoryConfig.validate`` (the checks a user gets when applying the flags) and, for a resize, Megatron
Core's layout rules. An option the estimate cannot predict is recorded with its cost and the estimate's
reason, without a peak. Those options are the decision-order table (among options of one step with equal predicted
peaks, the fastest first: :func:`order_equal_memory`). The answer is the fastest fitting combination of the levers
reachable from the layout as given (:mod:`.search.reachable`, by the search's rule: no lever that does not lower its
peak), or CPU offloading where it fits faster (:func:`fastest_answer`), as a :class:`MemoryConfig` and as override
strings that Bridge's own override
parser turns into the same config (the PEFT change only where overrides built the PEFT; otherwise a
note says why not and gives the ``MemoryConfig(...).apply(cfg)`` line).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.estimate import trace_cache, unmodelled
from megatron_bridge_ext.estimate.bridge import BridgeEstimate
from megatron_bridge_ext.estimate.memory import NotModelled
from megatron_bridge_ext.estimate.report import MemoryEstimate
from megatron_bridge_ext.findings import ERROR, Finding, Refused
from megatron_bridge_ext.levers.allocator import advice as allocator_advice
from megatron_bridge_ext.levers.lora_input import advice as lora_input_advice
from megatron_bridge_ext.levers.parallelism import advice as parallelism_advice
from megatron_bridge_ext.levers.recompute import advice as recompute_advice
from megatron_bridge_ext.levers import steptime
from megatron_bridge_ext.levers.parallelism.cost import moe_shape
from megatron_bridge_ext.levers.step import Option, State, breakdown
from megatron_bridge_ext.overrides import PEFT_OBJECT_REASON
from megatron_bridge_ext.search import reachable

MARGIN = 0.10
"""Share of device memory kept free without expandable segments: a caching allocator that fragments
can hold this much reserved but unusable (``mbx diagnose`` calls an OOM fragmentation from 10% of
reserved memory), and the estimate leaves out NCCL buffers, the CUDA context and kernel workspaces."""
EXPANDABLE_MARGIN = 0.03
"""Share kept free with expandable segments: no split segments, only block rounding and what the
estimate leaves out."""
EQUAL_PEAK_SHARE = 0.005
"""Predicted peaks within this share of each other are equal memory (0.2 GiB at 40 GiB: well under what the
estimate leaves out, which the margin covers); between such options the plan puts the faster first."""
OFFLOAD_STEP = 5
"""CPU offloading's step in the decision order."""
STEPS = (allocator_advice.options, lora_input_advice.options, recompute_advice.options, parallelism_advice.resize,
         parallelism_advice.offload)
"""The levers' advice in decision order (:data:`megatron_bridge_ext.evidence.LEVERS`), each on top of the ones before."""


@dataclass
class Plan:
    """The estimate as the config stands, Bridge's beside it, and the options tried in order.

    ``baseline`` is None when our estimate does not model the config (``refused`` says why): Bridge's
    figure is then the only one, and the plan has no verdict and no levers. ``bridge_error`` says why
    Bridge's estimate failed, when it did (``bridge`` is then None).
    """

    gpu_memory: int
    margin: float
    expandable_margin: float
    expandable_segments: bool
    baseline: Optional[MemoryEstimate]
    bridge: Optional[BridgeEstimate]
    options: list[Option]
    notes: list[str] = field(default_factory=list)
    """How the config's builder decided settings the user left to it (printed with the config)."""
    refused: Optional[Refused] = None
    bridge_error: Optional[str] = None
    layout: dict = field(default_factory=dict)
    """The config's parallel sizes and shape as set (:func:`layout_of`), for a plan without our estimate."""
    not_modelled: list[str] = field(default_factory=list)
    """What no figure of the plan counts in this config, one line each (:mod:`.estimate.unmodelled`)."""
    gpu: steptime.Gpu = field(default_factory=steptime.gpu)
    """The device whose peak rates price each option's step time."""
    step_time: Optional[steptime.StepTime] = None
    """The predicted step time of the config as is (None without our estimate)."""
    strategies: list[lora_input_advice.StrategyPeak] = field(default_factory=list)
    """Each LoRA-A input strategy on the config as is, re-estimated (empty where none can act)."""
    answer: Optional[Option] = None
    """The fastest option that fits (:func:`fastest_answer`): the levers' fastest fitting combination, or an option
    of the decision order that fits faster (CPU offloading is no part of the combinations)."""

    @property
    def usable_now(self) -> int:
        return _usable(self.gpu_memory, self.expandable_margin if self.expandable_segments else self.margin)

    @property
    def fits_as_is(self) -> Optional[bool]:
        """Whether our estimate's peak fits; None without our estimate (Bridge's is not PEFT-aware: no verdict)."""
        return None if self.baseline is None else self.baseline.peak_bytes <= self.usable_now

    @property
    def chosen(self) -> Optional[Option]:
        """The answer (``answer`` in the text and the JSON)."""
        return self.answer

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
                "fits_as_is": self.fits_as_is, "estimate": self.baseline.as_dict() if self.baseline else None,
                "estimate_refused": [f.to_dict() for f in self.refused.findings] if self.refused else None,
                "bridge_estimate": self.bridge.as_dict() if self.bridge else None,
                "bridge_estimate_error": self.bridge_error, "layout": self.layout, "not_modelled": self.not_modelled,
                "gpu": self.gpu.as_dict(), "step_time_s": self.step_time.as_dict() if self.step_time else None,
                "lora_input_strategies": [p.as_dict() for p in self.strategies],
                "options": [o.as_dict() for o in self.options], "notes": self.notes,
                "answer": None if chosen is None else {"step": chosen.step, "lever": chosen.lever,
                                                       "label": chosen.label, "memory_config": chosen.flags,
                                                       "overrides": chosen.overrides, "peft_note": chosen.peft_note,
                                                       "peak_bytes": chosen.peak_bytes,
                                                       "step_time_pct": chosen.cost.step_time_pct,
                                                       "saves": chosen.saves}}


def _usable(gpu_memory: int, margin: float) -> int:
    return int(gpu_memory * (1 - margin))


class Planner:
    """What every lever's advice records its options through: the estimate, the usable memory, the answer so far."""

    def __init__(self, *, gpu_memory: int, margin: float, expandable_margin: float, expandable_segments: bool,
                 estimate_options: dict, cfg, peft_overrides: Optional[list[str]],
                 gpu: Optional[steptime.Gpu] = None):
        self.gpu_memory, self.margin, self.expandable_margin = gpu_memory, margin, expandable_margin
        self.expandable = expandable_segments
        self.estimate_options = estimate_options
        self.cfg, self.peft_overrides = cfg, peft_overrides
        self.options: list[Option] = []
        self.gpu = gpu or steptime.gpu()
        self.step_time: Optional[steptime.StepTime] = None
        self.as_is: Optional[MemoryEstimate] = None
        self.strategy_estimates: dict[str, MemoryEstimate] = {}
        """Estimates of the config as is (:attr:`as_is`) with each LoRA-A input strategy, made for the plan's
        comparison (:func:`~megatron_bridge_ext.levers.lora_input.advice.compare`); step 2 reuses its own while its
        state is still the config as is."""
        """The config as is, set once its estimate ran: each option's step time is priced against it (no price
        without it)."""

    def estimate(self, cfg, **overrides) -> MemoryEstimate:
        from megatron_bridge_ext.estimate import estimate

        return estimate(cfg, **{**self.estimate_options, **overrides})

    def usable(self) -> int:
        return _usable(self.gpu_memory, self.expandable_margin if self.expandable else self.margin)

    def add(self, option: Option, state: State, *, peak: Optional[int] = None,
            parts: Optional[dict[str, int]] = None) -> Option:
        """Record ``option`` as reached from ``state`` (its flags, overrides and, when applicable, its estimate)."""
        self.options.append(self.fill(option, state, peak=peak, parts=parts))
        return option

    def fill(self, option: Option, state: State, *, peak: Optional[int] = None, parts: Optional[dict[str, int]] = None,
             flags_on=None) -> Option:
        """Set ``option``'s flags, overrides and, when applicable, peak and step time from ``state``. The flags'
        overrides are taken against ``flags_on`` (default: the config as is); ``state.overrides`` follow them."""
        flags_on = self.cfg if flags_on is None else flags_on
        option.usable_bytes = self.usable()
        option.flags = dict(state.flags)
        option.config = state.cfg
        flags = MemoryConfig(**state.flags) if state.flags else None
        option.overrides = (flags.overrides(flags_on, peft_overrides=self.peft_overrides) if flags else []) \
            + list(state.overrides)
        if flags and flags.peft_needs_python(flags_on, peft_overrides=self.peft_overrides):
            option.peft_note = (f"peft: overrides cannot change this cfg.peft ({PEFT_OBJECT_REASON}); in the training "
                                f"script: {_python_line(state.flags)}")
        if option.applicable:
            option.peak_bytes = state.est.peak_bytes if peak is None else peak
            option.breakdown = breakdown(state.est) if parts is None else parts
            if self.step_time is not None:
                after = steptime.step_time(state.est.settings, self.gpu,
                                           offload_bytes=(option.cost.pcie_bytes or 0) + _fine_grained_bytes(state.est),
                                           moe=moe_shape(state.cfg.model))
                option.cost.step_time_pct = steptime.change_pct(self.step_time, after)
        return option

    def done(self) -> bool:
        return any(o.fits for o in self.options)


def plan(cfg, *, gpu_memory: int, margin: float = MARGIN, expandable_margin: float = EXPANDABLE_MARGIN,
         expandable_segments: Optional[bool] = None, estimate_options: Optional[dict] = None,
         with_bridge: bool = True, peft_overrides: Optional[list[str]] = None,
         gpu: Optional[steptime.Gpu] = None) -> Plan:
    """Estimate ``cfg`` and, if it does not fit ``gpu_memory`` bytes per GPU, walk the levers until one fits and
    answer with their fastest fitting combination (:mod:`.search.reachable`). The estimates share traces
    (:mod:`.estimate.trace_cache`): a trace depends on no more than its key.

    ``expandable_segments``: whether the run already has them (default: from ``cfg.env_vars``).
    ``estimate_options`` are passed to :func:`megatron_bridge_ext.estimate.estimate`.
    ``peft_overrides``: how overrides built ``cfg.peft`` on a recipe without one
    (:attr:`megatron_bridge_ext.estimate.configs.Built.peft_overrides`); None, the default, for a
    ``cfg.peft`` set in Python, whose changes the answer gives as a Python line instead of overrides.
    ``gpu``: the device that prices each option's step time (default: the
    :data:`~megatron_bridge_ext.levers.steptime.DEFAULT_GPU` preset).
    """
    with trace_cache.reuse():
        return _plan(cfg, gpu_memory=gpu_memory, margin=margin, expandable_margin=expandable_margin,
                     expandable_segments=expandable_segments, estimate_options=estimate_options,
                     with_bridge=with_bridge, peft_overrides=peft_overrides, gpu=gpu)


def _plan(cfg, *, gpu_memory: int, margin: float, expandable_margin: float, expandable_segments: Optional[bool],
          estimate_options: Optional[dict], with_bridge: bool, peft_overrides: Optional[list[str]],
          gpu: Optional[steptime.Gpu]) -> Plan:
    gpu = gpu or steptime.gpu()
    if gpu_memory <= 0:
        raise Refused("plan", [Finding("bad_input", ERROR, "gpu_memory", f"is {gpu_memory}",
                                       "give the device's memory in bytes, e.g. 80 * 2**30 for 80 GiB")])
    if expandable_segments is None:
        expandable_segments = _expandable_in(cfg)
    planner = Planner(gpu_memory=gpu_memory, margin=margin, expandable_margin=expandable_margin,
                       expandable_segments=expandable_segments, estimate_options=dict(estimate_options or {}),
                       cfg=cfg, peft_overrides=peft_overrides, gpu=gpu)
    try:
        baseline = planner.estimate(cfg)
    except NotModelled as refused:
        bridge, error = _bridge(cfg, with_bridge)
        return Plan(gpu_memory, margin, expandable_margin, expandable_segments, None, bridge, [], refused=refused,
                    bridge_error=error, layout=layout_of(cfg), not_modelled=unmodelled.config_lines(cfg), gpu=gpu)
    # Every later estimate keeps the baseline's DP and microbatches unless a lever changes them.
    planner.estimate_options.update(data_parallel_size=baseline.settings.dp,
                                    num_microbatches=baseline.settings.num_microbatches)
    bridge, error = _bridge(cfg, with_bridge, data_parallel_size=baseline.settings.dp,
                            num_microbatches=baseline.settings.num_microbatches)
    planner.step_time = steptime.step_time(baseline.settings, gpu, offload_bytes=_fine_grained_bytes(baseline),
                                           moe=moe_shape(cfg.model))
    result = Plan(gpu_memory, margin, expandable_margin, expandable_segments, baseline, bridge, planner.options,
                  bridge_error=error, layout=layout_of(cfg), not_modelled=unmodelled.config_lines(cfg), gpu=gpu,
                  step_time=planner.step_time, strategies=lora_input_advice.compare(planner, cfg, baseline))
    if result.fits_as_is:
        return result
    state = State(copy.deepcopy(cfg), baseline)
    before_recompute = None
    for step in STEPS:
        if step is recompute_advice.options:
            before_recompute = state.copy()
        if step is parallelism_advice.offload:
            state = before_recompute  # offloading excludes recompute: it replaces step 3, on top of steps 1-2
        state = step(planner, state)
        if planner.done():
            break
    planner.options[:] = order_equal_memory(planner.options)
    combined = reachable.answer(planner, cfg, baseline, usable=result.usable_now,
                                usable_expandable=planner.usable(), expandable_on=expandable_segments)
    result.answer = fastest_answer(combined, planner.options)
    return result


def fastest_answer(combined: Optional[Option], walked: list[Option]) -> Optional[Option]:
    """The levers' fastest fitting combination, unless CPU offloading (no part of the combinations) fits faster; with
    no combination that fits (or none priced), the first option of the decision order that fits."""
    offloads = [o for o in walked if o.fits and o.step == OFFLOAD_STEP and o.cost.step_time_pct is not None]
    fitting = ([combined] if combined is not None and combined.cost.step_time_pct is not None else []) + offloads
    if fitting:
        return min(fitting, key=lambda o: o.cost.step_time_pct)
    return combined or next((o for o in walked if o.fits), None)


def order_equal_memory(options: list[Option]) -> list[Option]:
    """``options`` in decision order, except that within a step a run of applicable options whose predicted
    peaks are equal (within :data:`EQUAL_PEAK_SHARE` of the run's first) is put fastest first: the same memory
    for less step time (a stable sort: equal times keep their order)."""
    out: list[Option] = []
    run: list[Option] = []

    def flush():
        out.extend(sorted(run, key=lambda o: o.cost.step_time_pct))
        run.clear()

    for option in options:
        if not (run and _equal_memory(run[0], option)):
            flush()
        if option.applicable and option.cost.step_time_pct is not None:
            run.append(option)
        else:
            out.append(option)
    flush()
    return out


def _equal_memory(first: Option, other: Option) -> bool:
    return (other.applicable and other.step == first.step and other.cost.step_time_pct is not None
            and abs(other.peak_bytes - first.peak_bytes) <= EQUAL_PEAK_SHARE * first.peak_bytes)


def _bridge(cfg, wanted: bool, **sizes) -> tuple[Optional[BridgeEstimate], Optional[str]]:
    """Bridge's estimate, or why it failed as one line (its exception's type and first line): a failure of
    Bridge's formula (some recipes leave fields it reads unset) leaves the rest of the plan standing."""
    from megatron_bridge_ext.estimate.bridge import bridge_estimate

    if not wanted:
        return None, None
    try:
        return bridge_estimate(cfg, **sizes), None
    except Exception as error:  # upstream code: any exception type is possible
        text = str(error).strip()
        return None, f"{type(error).__name__}: {text.splitlines()[0] if text else '(no message)'}"


def layout_of(cfg) -> dict:
    """The parallel sizes, sequence, micro-batch and expert count of ``cfg`` as set (no estimate needed)."""
    from megatron_bridge_ext.levers.parallelism.constraints import expert_sizes

    model = cfg.model
    ep, etp = expert_sizes(model)
    return {"tp": model.tensor_model_parallel_size, "pp": model.pipeline_model_parallel_size,
            "cp": model.context_parallel_size or 1, "ep": ep, "etp": etp,
            "dp": getattr(cfg, "data_parallel_size", None), "sequence_parallel": bool(model.sequence_parallel),
            "seq_length": model.seq_length, "micro_batch": cfg.train.micro_batch_size,
            "num_moe_experts": getattr(model, "num_moe_experts", None),
            "moe_router_topk": getattr(model, "moe_router_topk", None) if getattr(model, "num_moe_experts", None)
            else None}


def _fine_grained_bytes(est) -> int:
    """The host-link bytes of a step under the config's fine-grained activation offloading (0 without it)."""
    from megatron_bridge_ext.levers.activation_offload.cost import step_bytes

    return step_bytes(est.offload_host_bytes, est.settings.num_microbatches)


def _python_line(flags: dict) -> str:
    return "MemoryConfig(" + ", ".join(f"{k}={v!r}" for k, v in flags.items()) + ").apply(cfg)"


def _expandable_in(cfg) -> bool:
    from megatron_bridge_ext.levers.allocator.options import effective, parse_version
    from megatron_bridge_ext.levers.allocator.env_plan import installed_torch_version

    env = {k: str(v) for k, v in (getattr(cfg, "env_vars", None) or {}).items()}
    _, conf = effective(env, parse_version(installed_torch_version()))
    return bool(conf.flag("expandable_segments"))


