"""The LoRA-A input in the plan: ``shard_local`` re-estimated, priced by its collective change."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from megatron_bridge_ext import evidence
from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.levers.lora_input import cost as lora_input_cost
from megatron_bridge_ext.levers.lora_input.config import PEFT_FIELD
from megatron_bridge_ext.levers.step import Cost, Option, State, blocking, evidence_for, validate

if TYPE_CHECKING:
    from megatron_bridge_ext.planner import Planner


def options(planner: Planner, state: State) -> State:
    """Step 2: ``shard_local`` on top of step 1, re-estimated, unless already in effect or refused."""
    lever = evidence_for("LoRA input under sequence parallelism")
    flags = MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False)
    constraints = validate(flags, state.cfg)
    current = state.est.settings.get(PEFT_FIELD)
    published = f"no published figure; upstream's regather for comparison: {evidence.QWEN3_8B_REGATHER}"
    blocked = "already shard_local" if current == "shard_local" else blocking(constraints)
    if blocked:
        planner.add(Option(2, lever["name"], f"{PEFT_FIELD}=shard_local", False, blocked,
                           cost=Cost(published=published), constraints=constraints), state)
        return state
    cfg = copy.deepcopy(state.cfg)
    flags.apply(cfg)
    change, basis = lora_input_cost.collective_change(state.est, "shard_local")
    new = State(cfg, planner.estimate(cfg), {**state.flags, PEFT_FIELD: "shard_local"}, list(state.overrides))
    planner.add(Option(2, lever["name"], f"{PEFT_FIELD}=shard_local", True, constraints=constraints,
                       cost=Cost(collective_bytes=change, published=published, basis=basis)), new)
    return new
