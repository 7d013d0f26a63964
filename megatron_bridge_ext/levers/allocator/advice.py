"""The allocator in the plan: expandable segments shrink the fragmentation margin (no memory saved, no cost)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.levers.step import Cost, Option, State, blocking, evidence_for, validate

if TYPE_CHECKING:
    from megatron_bridge_ext.planner import Planner


def options(planner: Planner, state: State) -> State:
    """Step 1: expandable segments, unless already on or refused; they change the margin every later option uses."""
    lever = evidence_for("allocator")
    constraints = validate(MemoryConfig(expandable_segments=True), state.cfg)
    cost = Cost(published=lever["cost"], source=lever["source"])
    if planner.expandable:
        state.flags["expandable_segments"] = True
        planner.add(Option(1, lever["name"], "expandable segments", False, "already on", cost=cost,
                           constraints=constraints), state)
        return state
    blocked = blocking(constraints)
    planner.expandable = blocked is None
    state.flags["expandable_segments"] = blocked is None
    planner.add(Option(1, lever["name"], "expandable segments", blocked is None, blocked or "", cost=cost,
                       constraints=constraints), state)
    return state
