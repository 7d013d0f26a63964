"""Megatron Bridge's own estimate (``estimate_training_memory``) for the same config, for comparison.

Bridge's estimator is formula-based and not PEFT-aware: it charges every parameter with gradients
and optimizer states (18 B, or 6 + 12 / DP with the distributed optimizer) and uses one activation
coefficient per layer that assumes sequence parallelism with selective recompute, whatever the
PEFT, recompute or attention settings. It is run on the same prepared config (mixed precision
applied, finalized) and with the same DP size and microbatch count as ours. It reads configs ours
does not model (mixture-of-experts, MLA, context parallelism, hybrid Mamba models, whose layer pattern it
does not read: :attr:`BridgeEstimate.caveats` says so): for those it is the one figure the plan shows.
A field it reads but the recipe leaves unset is named before its formula fails on it (:class:`MissingInput`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class BridgeEstimate:
    """Bridge's per-GPU components (name, bytes) and their sum, with Bridge's own assumptions."""

    components: list[tuple[str, int]]
    total_bytes: int
    assumptions: list[str]
    caveats: list[str] = field(default_factory=list)
    """Where Bridge's formula does not read this config as it is built (a hybrid model's layer pattern)."""

    def as_dict(self) -> dict:
        return {"components": [{"name": n, "bytes": b} for n, b in self.components], "total_bytes": self.total_bytes,
                "assumptions": list(self.assumptions), "caveats": list(self.caveats)}


def bridge_estimate(cfg, *, data_parallel_size: Optional[int] = None,
                    num_microbatches: Optional[int] = None) -> BridgeEstimate:
    from megatron.bridge.training.utils.theoretical_memory_utils import estimate_training_memory

    from megatron_bridge_ext.estimate import unmodelled
    from megatron_bridge_ext.estimate.memory import prepare

    prepared = prepare(cfg, data_parallel_size=data_parallel_size, num_microbatches=num_microbatches,
                       modelled_only=False)
    config = copy.copy(cfg)
    config.model, config.optimizer, config.ddp = prepared.provider, prepared.optimizer, prepared.ddp
    config.data_parallel_size = prepared.data_parallel
    _check_inputs(prepared.provider)
    result = estimate_training_memory(config, num_microbatches=prepared.num_microbatches, include_activation=True)
    components = [(c.name, round(c.memory_bytes)) for c in result.model_state_components]
    if result.activation is not None:
        components.append((result.activation.name, round(result.activation.memory_bytes)))
    caveat = unmodelled.bridge_caveat(prepared.provider)
    return BridgeEstimate(components, sum(b for _, b in components), list(result.assumptions),
                          [caveat] if caveat else [])


class MissingInput(ValueError):
    """A field Bridge's formula reads is unset, so its estimate would fail with an unexplained TypeError."""


def _check_inputs(provider) -> None:
    """Name the unset field before Bridge's formula trips on it: recipes that take the vocabulary from their
    tokenizer (set when training starts) leave ``vocab_size`` None, and ``_count_parameters`` multiplies by it."""
    if getattr(provider, "vocab_size", None) is None:
        raise MissingInput("model.vocab_size is None (the recipe takes it from its tokenizer when training starts) and "
                           "Bridge's formula multiplies by it (a TypeError in _count_parameters). Fix: give the "
                           "tokenizer's vocabulary size as an override, model.vocab_size=N")
