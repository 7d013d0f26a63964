"""The LoRA-input lever's flag, its checks, how it sets a Bridge PEFT config and which strategy is in effect.

``sequence_parallel_input_strategy`` is one name from end to end: the
:class:`~megatron_bridge_ext.config.MemoryConfig` flag, the field of our LoRA, DoRA and
CanonicalLoRA it sets, the override ``++peft.sequence_parallel_input_strategy=...``, the estimate's
setting and the plan's option. :func:`strategy_in_effect` is the one rule that says which strategy
a PEFT config runs, for the PEFT itself, the checks and the estimate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Optional

from megatron_bridge_ext.findings import ERROR, NO_EFFECT, WARNING, Finding
from megatron_bridge_ext.levers.change import Change
from megatron_bridge_ext.levers.lora_input import sp_lora
from megatron_bridge_ext.levers.lora_input.eligibility import ELIGIBLE_SURFACES, recompute_reason
from megatron_bridge_ext.overrides import hydra_value
from megatron_bridge_ext.peft import kinds

PEFT_FIELD = "sequence_parallel_input_strategy"
"""The name of the strategy everywhere: this lever's flag and the field of our PEFT classes."""
UPSTREAM_FLAG = "sequence_parallel_input_regather"
"""Bridge's own flag (>= 0.6), which asks for ``regather``."""


def strategy_in_effect(peft) -> str:
    """The strategy a LoRA-family PEFT config runs: its explicit ``sequence_parallel_input_strategy``,
    else ``regather`` when upstream's flag is set, else ``off``."""
    explicit = getattr(peft, PEFT_FIELD, None)
    if explicit is not None:
        return explicit
    return sp_lora.REGATHER if getattr(peft, UPSTREAM_FLAG, False) else sp_lora.OFF


def shard_local_wanted(cfg) -> bool:
    """Whether a LoRA-family PEFT runs in ``cfg`` with the LoRA-A input ``off`` (``shard_local`` then saves memory
    and traffic wherever SP is on)."""
    return cfg.peft is not None and is_lora_family(cfg.peft) and strategy_in_effect(cfg.peft) == "off"


def is_lora_family(peft) -> bool:
    """Bridge's LoRA, DoRA or CanonicalLoRA (ours derive from them)."""
    return kinds.kind_of(peft) is not None


@dataclass(kw_only=True)
class LoraInputConfig:
    """``sequence_parallel_input_strategy``: ``"regather"``, ``"shard_local"`` or ``"off"`` for a LoRA-family
    ``cfg.peft``, which becomes our class of the same kind with that field; None leaves ``cfg.peft`` alone."""

    sequence_parallel_input_strategy: Optional[str] = None

    def __post_init__(self) -> None:
        sp_lora.check_choice(self.sequence_parallel_input_strategy, f"MemoryConfig.{PEFT_FIELD}", allow_none=True)

    def findings(self, cfg, model_after_recompute) -> list[Finding]:
        """The checks against ``cfg``; ``model_after_recompute`` has the recompute fields the model will have."""
        strategy = self.sequence_parallel_input_strategy
        if strategy is None:
            return []
        model = cfg.model
        if cfg.peft is None or not is_lora_family(cfg.peft):
            return [Finding(f"{PEFT_FIELD}_needs_lora", ERROR, PEFT_FIELD,
                            "needs a LoRA PEFT config (LoRA, DoRA or CanonicalLoRA), found "
                            f"{type(cfg.peft).__name__}",
                            "set cfg.peft to Bridge's or megatron_bridge_ext.peft's LoRA, DoRA or CanonicalLoRA, or "
                            f"leave {PEFT_FIELD}=None")]
        if strategy == sp_lora.OFF:
            return []
        out = []
        if getattr(model, "tensor_model_parallel_size", 1) <= 1 or not getattr(model, "sequence_parallel", False):
            out.append(Finding(f"{PEFT_FIELD}_no_sp", NO_EFFECT, PEFT_FIELD,
                               f"{strategy} has no effect with TP={model.tensor_model_parallel_size} "
                               f"and sequence_parallel={model.sequence_parallel}: there is no gathered input to avoid",
                               f"enable model.sequence_parallel with TP > 1, or leave {PEFT_FIELD}=None"))
        return out + self._recompute_findings(cfg.peft, model_after_recompute)

    def _recompute_findings(self, peft, model) -> list[Finding]:
        """The eligibility rule for adapters inside recomputed regions, on the model as it will be configured."""
        strategy = self.sequence_parallel_input_strategy
        targets = kinds.targeted_layers(getattr(peft, "target_modules", None) or ELIGIBLE_SURFACES)
        out = []
        for surface in ELIGIBLE_SURFACES:
            if surface not in targets:
                continue
            reason = recompute_reason(model, surface, strategy)
            if reason:
                out.append(Finding(f"{PEFT_FIELD}_recompute", WARNING, PEFT_FIELD,
                                   f"{strategy} is not used for {surface}: {reason}",
                                   f"use {PEFT_FIELD}='shard_local'"))
        return out

    def apply(self, cfg) -> list[Change]:
        """Make ``cfg.peft`` our class of the same kind (every field kept) and set its strategy."""
        strategy = self.sequence_parallel_input_strategy
        if strategy is None:
            return []
        old = cfg.peft
        upstream_flag = bool(getattr(old, UPSTREAM_FLAG, False))
        ours = kinds.our_class(kinds.kind_of(old))
        changes = []
        if not isinstance(old, ours):
            if strategy == sp_lora.OFF and not upstream_flag:
                return []  # Bridge's class without the flag already takes the gathered input
            # Copies: the new object shares no mutable field (target lists, CanonicalLoRA's mapping) with the old.
            values = {f.name: copy.deepcopy(getattr(old, f.name))
                      for f in fields(old) if f.init and hasattr(old, f.name)}
            values.pop(UPSTREAM_FLAG, None)
            cfg.peft = ours(**values)
            changes.append(Change("peft", type(old).__module__ + "." + type(old).__name__,
                                  f"megatron_bridge_ext.peft.{ours.__name__}",
                                  "every other field kept" if upstream_flag else "same fields"))
        previous = strategy_in_effect(old)
        if upstream_flag:
            object.__setattr__(cfg.peft, UPSTREAM_FLAG, False)
            changes.append(Change(f"peft.{UPSTREAM_FLAG}", True, False, f"replaced by {PEFT_FIELD}={strategy!r}"))
        if getattr(cfg.peft, PEFT_FIELD) != strategy:
            setattr(cfg.peft, PEFT_FIELD, strategy)
            if previous != strategy:  # None -> "off" changes nothing a user would notice
                changes.append(Change(f"peft.{PEFT_FIELD}", previous, strategy))
        return changes

    @staticmethod
    def overrides(changes: list[Change], cfg, *, peft_overrides: Optional[list[str]]) -> list[str]:
        """The Bridge overrides that make :meth:`apply`'s ``changes`` to ``cfg.peft``, where overrides can.

        Overrides reach ``cfg.peft`` only where they built it: ``peft_overrides`` are the ones that built
        it beyond the user's own. Our class as ``_target_`` where the class changes, then
        ``peft_overrides`` (their ``_target_`` dropped when ours replaces it; ``++`` sets or adds), then
        each field set. ``peft_overrides`` None (a PEFT object set in Python, which Bridge's override
        parser cannot change): none.
        """
        if peft_overrides is None:
            return []
        swapped = any(c.field == "peft" for c in changes)
        out = [f"++peft._target_={kinds.public_target(kinds.kind_of(cfg.peft))}"] if swapped else []
        out += [o for o in peft_overrides if not (swapped and o.startswith("++peft._target_="))]
        return out + [f"++{c.field}={hydra_value(c.new)}" for c in changes if c.field != "peft"]
