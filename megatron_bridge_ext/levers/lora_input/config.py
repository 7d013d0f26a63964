"""The LoRA-input lever's flag, its checks, how it sets a Bridge PEFT config and which strategy is in effect.

``lora_sp_input`` (a :class:`~megatron_bridge_ext.config.MemoryConfig` flag) becomes the PEFT field
``sequence_parallel_input_strategy`` of our LoRA, DoRA or CanonicalLoRA; :func:`strategy_in_effect`
is the one rule that says which strategy a PEFT config runs, for the PEFT itself, the checks and
the estimate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Optional

from megatron_bridge_ext.findings import ERROR, NO_EFFECT, WARNING, Finding
from megatron_bridge_ext.levers.change import Change
from megatron_bridge_ext.levers.lora_input import sp_lora
from megatron_bridge_ext.levers.lora_input.eligibility import ELIGIBLE_SURFACES, recompute_reason
from megatron_bridge_ext.peft import kinds

PEFT_FIELD = "sequence_parallel_input_strategy"
"""The field of our PEFT classes that holds the strategy."""
UPSTREAM_FLAG = "sequence_parallel_input_regather"
"""Bridge's own flag (>= 0.6), which asks for ``regather``."""


def strategy_in_effect(peft) -> str:
    """The strategy a LoRA-family PEFT config runs: its explicit ``sequence_parallel_input_strategy``,
    else ``regather`` when upstream's flag is set, else ``off``."""
    explicit = getattr(peft, PEFT_FIELD, None)
    if explicit is not None:
        return explicit
    return sp_lora.REGATHER if getattr(peft, UPSTREAM_FLAG, False) else sp_lora.OFF


def is_lora_family(peft) -> bool:
    """Bridge's LoRA, DoRA or CanonicalLoRA (ours derive from them)."""
    return kinds.kind_of(peft) is not None


@dataclass(kw_only=True)
class LoraInputConfig:
    """``lora_sp_input``: ``"regather"``, ``"shard_local"`` or ``"off"`` for a LoRA-family ``cfg.peft``,
    which becomes our class of the same kind; None leaves ``cfg.peft`` alone."""

    lora_sp_input: Optional[str] = None

    def __post_init__(self) -> None:
        sp_lora.check_choice(self.lora_sp_input, "MemoryConfig.lora_sp_input", allow_none=True)

    def findings(self, cfg, model_after_recompute) -> list[Finding]:
        """The checks against ``cfg``; ``model_after_recompute`` has the recompute fields the model will have."""
        if self.lora_sp_input is None:
            return []
        model = cfg.model
        if cfg.peft is None or not is_lora_family(cfg.peft):
            return [Finding("lora_sp_input_needs_lora", ERROR, "lora_sp_input",
                            "needs a LoRA PEFT config (LoRA, DoRA or CanonicalLoRA), found "
                            f"{type(cfg.peft).__name__}",
                            "set cfg.peft to Bridge's or megatron_bridge_ext.peft's LoRA, DoRA or CanonicalLoRA, or "
                            "leave lora_sp_input=None")]
        if self.lora_sp_input == sp_lora.OFF:
            return []
        out = []
        if getattr(model, "tensor_model_parallel_size", 1) <= 1 or not getattr(model, "sequence_parallel", False):
            out.append(Finding("lora_sp_input_no_sp", NO_EFFECT, "lora_sp_input",
                               f"{self.lora_sp_input} has no effect with TP={model.tensor_model_parallel_size} "
                               f"and sequence_parallel={model.sequence_parallel}: there is no gathered input to avoid",
                               "enable model.sequence_parallel with TP > 1, or leave lora_sp_input=None"))
        return out + self._recompute_findings(cfg.peft, model_after_recompute)

    def _recompute_findings(self, peft, model) -> list[Finding]:
        """The eligibility rule for adapters inside recomputed regions, on the model as it will be configured."""
        targets = kinds.targeted_layers(getattr(peft, "target_modules", None) or ELIGIBLE_SURFACES)
        out = []
        for surface in ELIGIBLE_SURFACES:
            if surface not in targets:
                continue
            reason = recompute_reason(model, surface, self.lora_sp_input)
            if reason:
                out.append(Finding("lora_sp_input_recompute", WARNING, "lora_sp_input",
                                   f"{self.lora_sp_input} is not used for {surface}: {reason}",
                                   "use lora_sp_input='shard_local'"))
        return out

    def apply(self, cfg) -> list[Change]:
        """Make ``cfg.peft`` our class of the same kind (every field kept) and set its strategy."""
        if self.lora_sp_input is None:
            return []
        old = cfg.peft
        upstream_flag = bool(getattr(old, UPSTREAM_FLAG, False))
        ours = kinds.our_class(kinds.kind_of(old))
        changes = []
        if not isinstance(old, ours):
            if self.lora_sp_input == sp_lora.OFF and not upstream_flag:
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
            changes.append(Change(f"peft.{UPSTREAM_FLAG}", True, False,
                                  f"replaced by {PEFT_FIELD}={self.lora_sp_input!r}"))
        if getattr(cfg.peft, PEFT_FIELD) != self.lora_sp_input:
            setattr(cfg.peft, PEFT_FIELD, self.lora_sp_input)
            if previous != self.lora_sp_input:  # None -> "off" changes nothing a user would notice
                changes.append(Change(f"peft.{PEFT_FIELD}", previous, self.lora_sp_input))
        return changes
