"""The LoRA-A input in the plan: ``shard_local`` re-estimated, priced by its collective change."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_bridge_ext import evidence
from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.estimate import te, te_fp8
from megatron_bridge_ext.estimate.report import ACTIVATIONS, MemoryEstimate
from megatron_bridge_ext.estimate.trace import LORA_INPUTS
from megatron_bridge_ext.findings import Refused
from megatron_bridge_ext.levers.lora_input import cost as lora_input_cost
from megatron_bridge_ext.levers.lora_input.collectives import OFF, REGATHER, SHARD_LOCAL
from megatron_bridge_ext.levers.lora_input.config import PEFT_FIELD, is_lora_family
from megatron_bridge_ext.levers.step import Cost, Option, State, blocking, evidence_for, validate

if TYPE_CHECKING:
    from megatron_bridge_ext.planner import Planner


def options(planner: Planner, state: State) -> State:
    """Step 2: ``shard_local`` on top of step 1, re-estimated, unless already in effect or refused."""
    lever = evidence_for("LoRA input under sequence parallelism")
    flags = MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False)
    out_of_scope = _not_lora(state.cfg)
    constraints = [] if out_of_scope else validate(flags, state.cfg)
    peft = state.est.settings.peft
    current = peft.sequence_parallel_input_strategy if peft else None
    published = f"no published figure; upstream's regather for comparison: {evidence.QWEN3_8B_REGATHER}"
    blocked = out_of_scope or ("already shard_local" if current == "shard_local" else blocking(constraints))
    if blocked:
        planner.add(Option(2, lever["name"], f"{PEFT_FIELD}=shard_local", False, blocked,
                           cost=Cost(published=published), constraints=constraints), state)
        return state
    cfg = copy.deepcopy(state.cfg)
    flags.apply(cfg)
    change, basis = lora_input_cost.collective_change(state.est, "shard_local")
    known = planner.strategy_estimates.get("shard_local") if state.est is planner.as_is else None
    new = State(cfg, known or planner.estimate(cfg), {**state.flags, PEFT_FIELD: "shard_local"}, list(state.overrides))
    planner.add(Option(2, lever["name"], f"{PEFT_FIELD}=shard_local", True, constraints=constraints,
                       cost=Cost(collective_bytes=change, published=published, basis=basis)), new)
    return new


def _not_lora(cfg) -> str:
    """Why step 2 does not act on a run without a LoRA-family PEFT (full fine-tuning too); empty when it can.
    Said as the lever's scope, not as a fix: a full fine-tuning run has nothing to change into LoRA here."""
    if cfg.peft is not None and is_lora_family(cfg.peft):
        return ""
    run = "full fine-tuning (no PEFT)" if cfg.peft is None else type(cfg.peft).__name__
    return f"applies to LoRA runs only (LoRA, DoRA, CanonicalLoRA); this run is {run}: the next lever follows"


@dataclass(frozen=True)
class StrategyPeak:
    """One LoRA-A input strategy on the config as is: its predicted peak, or why it does not apply."""

    strategy: str
    peak_bytes: Optional[int]
    lora_input_bytes: Optional[int] = None
    reason: str = ""

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "peak_bytes": self.peak_bytes, "lora_input_bytes": self.lora_input_bytes,
                "reason": self.reason}


COMPARED = (OFF, REGATHER, SHARD_LOCAL)
"""The strategies the plan puts side by side, in that order."""


def compare(planner: Planner, cfg, baseline: MemoryEstimate) -> list[StrategyPeak]:
    """Each strategy on ``cfg`` as it stands (no other lever), re-estimated, so that the plan shows the LoRA-A input
    saving of each whether or not the config fits; empty where no strategy can act (no LoRA-family PEFT, or no
    sequence parallelism with TP > 1). The estimates are kept on ``planner`` for step 2 (:func:`options`)."""
    settings = baseline.settings
    planner.as_is, planner.strategy_estimates = baseline, {}
    if cfg.peft is None or not is_lora_family(cfg.peft) or not settings.sequence_parallel:
        return []
    current = settings.peft.sequence_parallel_input_strategy
    out = []
    for strategy in COMPARED:
        if strategy == current:
            out.append(StrategyPeak(strategy, baseline.peak_bytes, _lora_inputs(baseline), "as is"))
            continue
        flags = MemoryConfig(sequence_parallel_input_strategy=strategy, expandable_segments=False)
        blocked = blocking(validate(flags, cfg))
        if blocked:
            out.append(StrategyPeak(strategy, None, None, blocked))
            continue
        changed = copy.deepcopy(cfg)
        flags.apply(changed)
        try:
            est = planner.estimate(changed)
        except Refused as refused:
            out.append(StrategyPeak(strategy, None, None, refused.findings[0].text()))
            continue
        planner.strategy_estimates[strategy] = est
        out.append(StrategyPeak(strategy, est.peak_bytes, _lora_inputs(est)))
    return out


def _lora_inputs(est: MemoryEstimate) -> int:
    """The activations the LoRA-A inputs keep, TE's norm-output shards beside them included."""
    return sum(c.bytes for c in est.components if c.kind == ACTIVATIONS and c.name in LORA_INPUT_COMPONENTS)


LORA_INPUT_COMPONENTS = (LORA_INPUTS, te.SHARDS, te_fp8.FP8_SHARDS)
"""The estimate's activation lines a LoRA-A input strategy changes."""
