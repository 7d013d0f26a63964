"""The Bridge runs a test module of Bridge's loop plans, made once, in order, on both ranks.

``tests/functional/test_bridge_loop.py`` (the dense recipe) and ``test_bridge_loop_moe.py`` (its
mixture-of-experts variant) each list their runs as :class:`Planned` and make them in one module
fixture with :func:`run_all`; the tests then read the :class:`Outcome` of a run with
:func:`outcome_of`. Our LoRA comes in exactly as the docs tell users: ``MemoryConfig(...).apply(cfg)``
on a config whose ``cfg.peft`` is Bridge's LoRA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import traceback
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_bridge_ext.testing.bridge import recipe, runner
from tests.support.bridge_session import Session, bridge_session, timeout_minutes
from tests.support.dist_checks import assert_no_problems, max_over_ranks

USER_ALLOCATOR_OPTION = ("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
"""A recipe's own allocator option, which MemoryConfig must keep (Bridge 0.6.2's recipes set expandable
segments already)."""
OUR_LOGGER = "megatron_bridge_ext"
FP32 = torch.finfo(torch.float32)


@dataclasses.dataclass
class Planned:
    """One Bridge run: which entry point, and how its config is made."""

    name: str
    entry: str
    config: Callable[[], object]
    memory: Optional[dict] = None  # MemoryConfig fields, applied as the docs say
    meter: bool = False
    keep_gradients: bool = False
    user_env_vars: Optional[dict] = None  # added to the recipe's cfg.env_vars (Bridge >= 0.6) before MemoryConfig
    unclipped: bool = False  # clip_grad=0: Core's clipping asserts fp32 gradients (clip_grads.py)


@dataclasses.dataclass
class Outcome:
    run: Optional[runner.Run] = None
    summary: object = None  # what MemoryConfig.apply returned
    env_vars: dict = dataclasses.field(default_factory=dict)
    peft: object = None  # cfg.peft as the run used it
    log: list[str] = dataclasses.field(default_factory=list)  # our package's INFO and higher records during the run
    error: Optional[str] = None


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def our_log() -> Iterator[list[str]]:
    """The messages our package logs at INFO or higher while held (:func:`bridge_session` restores the level)."""
    logger, handler = logging.getLogger(OUR_LOGGER), _Messages()
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def bridge_applies_env_vars() -> bool:
    """Whether this Bridge's ConfigContainer has ``env_vars`` (Bridge >= 0.6 applies them to each rank)."""
    from megatron.bridge.training.config import ConfigContainer

    return any(f.name == "env_vars" for f in dataclasses.fields(ConfigContainer))


def execute(planned: Planned, session: Session) -> Outcome:
    """Make one planned run; an exception is recorded in the outcome, not raised."""
    from megatron_bridge_ext.config import MemoryConfig
    from megatron_bridge_ext.levers.lora_input import sp_input

    outcome = Outcome()
    session.next_run()
    sp_input.new_run()  # each planned run stands for a launch of its own: its reasons are logged anew
    try:
        cfg = planned.config()
        cfg.dist.distributed_timeout_minutes = timeout_minutes()
        if planned.unclipped:
            cfg.optimizer.clip_grad = 0.0
        if planned.user_env_vars and bridge_applies_env_vars():
            cfg.env_vars.update(planned.user_env_vars)
        if planned.memory is not None:
            outcome.summary = MemoryConfig(**planned.memory).apply(cfg)
        outcome.env_vars = dict(getattr(cfg, "env_vars", None) or {})
        outcome.peft = cfg.peft
        with our_log() as outcome.log:
            outcome.run = runner.run(planned.entry, cfg, meter=planned.meter, keep_gradients=planned.keep_gradients)
    except Exception:  # recorded, then shared with the other rank: both stop together
        outcome.error = traceback.format_exc(limit=-8)
    return outcome


def run_all(plans: list[Planned]) -> dict[str, Outcome]:
    """Every planned run, in order, on both ranks; after a failure on any rank no further run starts."""
    outcomes: dict[str, Outcome] = {}
    with bridge_session() as session:
        for planned in plans:
            outcomes[planned.name] = outcome = execute(planned, session)
            if max_over_ranks(1.0 if outcome.error else 0.0, dist.group.WORLD):
                break
    return outcomes


def outcome_of(runs: dict[str, Outcome], name: str) -> runner.Run:
    """The run ``name``; fails (on both ranks) when it did not complete on some rank."""
    outcome = runs.get(name)
    problem = ("not run: an earlier run failed" if outcome is None
               else f"failed on this rank:\n{outcome.error}" if outcome.error else None)
    assert_no_problems([f"{name}: {problem}"] if problem else [], dist.group.WORLD)
    return outcome.run


def last(run: runner.Run, count: int) -> tuple[list, list]:
    """The losses and grad norms of a run's last ``count`` iterations."""
    return run.losses()[-count:], run.grad_norms()[-count:]


def loop_problems(runs: dict[str, Outcome], plans: list[Planned], applied: dict[str, str]) -> list[str]:
    """What is wrong with a test module's runs as a whole: each ran its iterations (a pretrain 1-2, a resumed
    fine-tune 3-4, a fresh one 1-4) with finite losses and grad norms, and in each run of ``applied`` (run name ->
    strategy) MemoryConfig.apply made cfg.peft our LoRA with that strategy."""
    problems = []
    for planned in plans:
        run = outcome_of(runs, planned.name)
        resumed = "<-" in planned.name
        expected = [1, 2] if planned.entry == "pretrain" else [3, 4] if resumed else [1, 2, 3, 4]
        iterations = [s.iteration for s in run.steps]
        if iterations != expected:
            problems.append(f"{planned.name}: iterations {iterations}, expected {expected}")
        numbers = run.losses() + ([] if planned.unclipped else run.grad_norms())
        if not all(v is not None and math.isfinite(v) for v in numbers):
            problems.append(f"{planned.name}: losses {run.losses()} grad norms {run.grad_norms()}")
    for name, strategy in applied.items():
        changes = {c.field: c.new for c in runs[name].summary.changes}
        if changes.get("peft") != "megatron_bridge_ext.peft.LoRA" or \
                changes.get("peft.sequence_parallel_input_strategy") != strategy:
            problems.append(f"{name}: MemoryConfig.apply changed {changes}")
    return problems


def allocator_problems(outcome: Outcome) -> list[str]:
    """What is wrong with the allocator variables of a run whose recipe kept :data:`USER_ALLOCATOR_OPTION`.

    Bridge >= 0.6: ``cfg.env_vars`` after ``MemoryConfig.apply`` holds the recipe's option with expandable
    segments added, and the rank's environment has it at every iteration. Bridge 0.5.1's ConfigContainer has
    no ``env_vars``: MemoryConfig must say so (``bridge_ignores_env_vars``) rather than pretend.
    """
    from megatron_bridge_ext.levers.allocator.options import VARIABLES

    allocator = {name: str(value) for name, value in outcome.env_vars.items() if name in VARIABLES}
    problems = []
    if bridge_applies_env_vars():
        if allocator != {USER_ALLOCATOR_OPTION[0]: USER_ALLOCATOR_OPTION[1] + ",expandable_segments:True"}:
            problems.append(f"MemoryConfig.apply left cfg.env_vars with {allocator}")
        for step in outcome.run.steps:
            seen = {name: step.environment.get(name) for name in allocator}
            if seen != allocator:
                problems.append(f"iteration {step.iteration}: the rank's environment has {seen}, "
                                f"cfg.env_vars {allocator}")
    else:
        codes = [f.code for f in outcome.summary.findings]
        if "bridge_ignores_env_vars" not in codes:
            problems.append(f"this Bridge ignores cfg.env_vars and MemoryConfig.apply did not say so: {codes}")
    return problems


# --------------------------------------------------------------------------------------------
# shard_local against exact arithmetic: runs "bridge <- bridge", "float64 bridge <- bridge" (unclipped,
# keep_gradients), "shard_local <- bridge" (keep_gradients), "shard_local" and "bridge"
# --------------------------------------------------------------------------------------------

def rel_diff(got: list, want: list) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def gradient_error(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over every trainable parameter (this rank's shards), in float64."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    difference = sum(float((got[k] - want[k]).norm() ** 2) for k in want)
    return math.sqrt(difference / sum(float(want[k].norm() ** 2) for k in want))


def fp32_bound(runs: dict[str, Outcome]) -> float:
    """How far an fp32 run of these steps may be from exact arithmetic, measured against float64.

    ``float64 bridge <- bridge`` resumes Bridge's step-2 checkpoint in float64 (its fp32 weights and
    optimizer state load into float64 exactly), and ``bridge <- bridge`` resumes it in fp32: at
    iteration 3 both start from the same weights, so the distance between their gradients is the
    fp32 rounding error of one step of this computation (the largest over the ranks). ``shard_local``
    does the same arithmetic except for the order of two sums (LoRA-A's GEMM over the local sequence
    shard, its weight gradient reduce-scattered); that reordering changes the result by no more than
    rounding does, so ``shard_local``'s own error is at most Bridge's error plus that much again: the
    bound is twice Bridge's measured error. A gradient that is wrong (a missing reduction, a wrong
    shard, a 1e-4 scaling of LoRA-A's gradient) misses it by orders of magnitude.

    The float64 run has gradient clipping off (Megatron Core's clipping asserts fp32 gradients); that is
    the same arithmetic as long as the fp32 runs' grad norms stay below ``clip_grad`` (checked).
    """
    bridge, reference = outcome_of(runs, "bridge <- bridge"), outcome_of(runs, "float64 bridge <- bridge")
    clip_grad = recipe.tiny_recipe(train_iters=1).optimizer.clip_grad
    problems = [] if reference.steps[0].dtypes == ["torch.float64"] else [
        f"the reference ran in {reference.steps[0].dtypes}, not float64"]
    if not max(bridge.grad_norms()) < clip_grad:
        problems.append(f"fp32 grad norms {bridge.grad_norms()} reach clip_grad={clip_grad}: the unclipped "
                        "float64 run is not the same arithmetic")
    error = max_over_ranks(gradient_error(bridge.steps[0].gradients, reference.steps[0].gradients), dist.group.WORLD)
    if not error > 0.0:
        problems.append("Bridge's fp32 gradient equals the float64 one: the comparison proves nothing")
    assert_no_problems(problems, dist.group.WORLD)
    return 2 * error


def scalar_tolerance(runs: dict[str, Outcome]) -> float:
    """For reported losses and grad norms: the fp32 bound, plus one fp32 ulp for rounding the reported value."""
    return fp32_bound(runs) + FP32.eps


def shard_local_gradient_problems(runs: dict[str, Outcome]) -> list[str]:
    """``shard_local <- bridge``'s first gradients (all adapters, and LoRA-A's alone) against the float64 run's,
    within :func:`fp32_bound`."""
    bound = fp32_bound(runs)
    reference = outcome_of(runs, "float64 bridge <- bridge").steps[0]
    ours = outcome_of(runs, "shard_local <- bridge").steps[0]  # from Bridge's checkpoint: the same weights
    error = gradient_error(ours.gradients, reference.gradients)
    lora_a = [k for k in reference.gradients if "linear_in" in k]
    lora_a_error = gradient_error({k: ours.gradients[k] for k in lora_a}, {k: reference.gradients[k] for k in lora_a})
    return [f"shard_local gradient error {e:.3g} ({what}) > fp32 bound {bound:.3g}"
            for what, e in (("all adapters", error), ("LoRA-A", lora_a_error)) if e > bound]


def shard_local_scalar_problems(runs: dict[str, Outcome]) -> list[str]:
    """``shard_local``'s losses and grad norms against Bridge's LoRA's (4 iterations, and resumed) and the resumed
    losses against the float64 run's, within :func:`scalar_tolerance`."""
    tolerance = scalar_tolerance(runs)
    pairs = (("shard_local", "bridge", True), ("shard_local <- bridge", "bridge <- bridge", True),
             ("shard_local <- bridge", "float64 bridge <- bridge", False))  # the reference has no grad norm
    problems = []
    for ours, theirs, with_norms in pairs:
        got, want = outcome_of(runs, ours), outcome_of(runs, theirs)
        error = rel_diff(got.losses(), want.losses())
        if with_norms:
            error = max(error, rel_diff(got.grad_norms(), want.grad_norms()))
        if error > tolerance:
            problems.append(f"{ours} vs {theirs}: relative difference {error:.3g} > {tolerance:.3g}")
    return problems
