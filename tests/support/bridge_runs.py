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
import traceback
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from megatron_bridge_ext.testing.bridge import runner
from tests.support.bridge_session import Session, bridge_session, timeout_minutes
from tests.support.dist_checks import assert_no_problems, max_over_ranks

USER_ALLOCATOR_OPTION = ("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
"""A recipe's own allocator option, which MemoryConfig must keep (Bridge 0.6.2's recipes set expandable
segments already)."""
OUR_LOGGER = "megatron_bridge_ext"


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

    outcome = Outcome()
    session.next_run()
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
