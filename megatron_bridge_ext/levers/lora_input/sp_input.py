"""What our LoRA, DoRA and CanonicalLoRA share: LoRA-A on the local sequence shard, decided per base layer.

Bridge builds every adapter exactly as it always does (same parameters, names, shapes, TP
attributes, checkpoints). For each base layer whose adapters are eligible (:mod:`.eligibility`) we
then (1) stop its adapters from gathering their input along the sequence
(``disable_sequence_parallel_comm``) — with TE, the fused LayerNorm returns its local output instead
of the gathered one — and (2) let each LoRA-A's ``ColumnParallelLinear`` run one of our autograd
functions from :mod:`.sp_lora` on the local shard, by giving the module a subclass that overrides
only ``forward``. Everything after LoRA-A (activation, dropout, LoRA-B, scaling, DoRA's magnitude,
CanonicalLoRA's q/k/v interleaving) stays Bridge's code.

Every adapter of a base layer receives the same tensor from Bridge's wrapper (``layernorm_output``),
and each strategy saves the tensor it is given, so the shard that CanonicalLoRA's three q/k/v (or
two up/gate) LoRA-A's keep is one storage. With adapter dropout each adapter keeps its own
dropped shard, as Bridge keeps its own dropped and gathered copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from megatron_bridge_ext.patches import bridge_lora_te_norm_grad, bridge_peft_without_te, bridge_truthful_te_detection

bridge_peft_without_te.import_bridge_peft()

from megatron.bridge.peft.adapter_wrapper import AdapterWrapper  # noqa: E402
from megatron.bridge.peft.utils import ParallelLinearAdapter  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)

from megatron_bridge_ext.levers.lora_input import sp_lora  # noqa: E402
from megatron_bridge_ext.levers.lora_input.config import strategy_in_effect  # noqa: E402
from megatron_bridge_ext.levers.lora_input.eligibility import Decision, decide_wrapper, is_te_layernorm_linear  # noqa: E402
from megatron_bridge_ext.peft import kinds  # noqa: E402

_LOGGED_REASONS: set[str] = set()
"""The fallback reasons already logged in this process: each once per run, however many PEFT objects (one per
variant of ``mbx demo``, say) meet it; ``report()`` still lists every adapter's."""


def new_run() -> None:
    """Forget the reasons logged so far, so that the next run in this process logs each again: for a process that
    runs several trainings one after another, each of which a user reads as a run of its own."""
    _LOGGED_REASONS.clear()


class SequenceParallelLoRAIn(ColumnParallelLinear):
    """LoRA-A that consumes the local sequence shard [s/t, b, h] and returns the full [s, b, r] input of LoRA-B.

    Same parameters and state as the ColumnParallelLinear it replaces (only ``forward`` differs);
    ``sequence_parallel_input_strategy`` names its strategy in
    :data:`megatron_bridge_ext.levers.lora_input.sp_lora.STRATEGIES` (the PEFT's field of that name, as decided
    for this adapter).
    When LoRA-A is frozen nothing needs its input for a weight gradient, so it falls back to the
    gathered path, which then retains nothing.
    """

    sequence_parallel_input_strategy: str = sp_lora.REGATHER

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        if not weight.requires_grad:
            gathered = gather_from_sequence_parallel_region(input_, group=self.tp_group)
            return gather_from_tensor_model_parallel_region(gathered.matmul(weight.t()), group=self.tp_group), None
        strategy = sp_lora.STRATEGIES[self.sequence_parallel_input_strategy]
        return strategy.output(input_, weight, self.tp_group, bool(self.gradient_accumulation_fusion)), None


def _allow_bridge_instantiation() -> None:
    """Let Bridge's ``_target_`` instantiation (overrides, saved run configs) build our classes.

    Bridge >= 0.6 only instantiates targets under an allowlist of module prefixes, which does not
    cover this package: a config naming ``megatron_bridge_ext.peft.LoRA`` (as a saved run config of
    a run with ``cfg.peft = LoRA(...)`` does) would be refused. Releases without the allowlist
    need nothing.
    """
    try:
        from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix
    except ImportError:
        return
    register_allowed_target_prefix("megatron_bridge_ext")


_allow_bridge_instantiation()


def adapters_of(wrapper: AdapterWrapper) -> list[tuple[str, ParallelLinearAdapter]]:
    """The parallel adapters of a Bridge wrapper, with their module paths under it.

    ``[("adapter", a)]`` for LoRA's and DoRA's wrappers; ``[("adapter.adapter_q", q), ...]`` for
    CanonicalLoRA's split wrappers (whose ModuleDict holds None for an untargeted q, k, v, up or gate).
    """
    adapter = wrapper.adapter
    if isinstance(adapter, ParallelLinearAdapter):
        return [("adapter", adapter)]
    if isinstance(adapter, nn.ModuleDict):
        return [(f"adapter.{key}", a) for key, a in adapter.items() if isinstance(a, ParallelLinearAdapter)]
    return []


def enable_sp_input(wrapper: AdapterWrapper, adapters: list[ParallelLinearAdapter], strategy: str) -> None:
    """Switch the adapters of one base layer to the sequence-local LoRA-A input (no new parameters)."""
    for adapter in adapters:
        adapter.disable_sequence_parallel_comm = True
        adapter.linear_in.__class__ = SequenceParallelLoRAIn
        adapter.linear_in.sequence_parallel_input_strategy = strategy
    if is_te_layernorm_linear(wrapper.to_wrap):
        wrapper.to_wrap.return_layernorm_output_gathered = False


@dataclass
class SequenceParallelInput:
    """The ``sequence_parallel_input_strategy`` field and its application, for a Bridge LoRA-family PEFT.

    Put it before Bridge's class: ``class DoRA(SequenceParallelInput, BridgeDoRA)``. Bridge's
    ``transform`` builds each wrapper; this one then decides for the wrapper's adapters together
    and switches them. ``report()`` lists every adapter Bridge created, with its decision.
    """

    sequence_parallel_input_strategy: Optional[str] = None
    """``"off"``, ``"regather"`` or ``"shard_local"``; None is off (our LoRA: ``regather`` with upstream's flag)."""

    def __post_init__(self) -> None:
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        self._decisions: dict[str, Decision] = {}

    def __setattr__(self, name: str, value) -> None:
        # Checked on every assignment, not only in __init__: Bridge's config overrides set fields
        # of an existing object, and an unknown strategy must not silently run as another one.
        if name == "sequence_parallel_input_strategy":
            sp_lora.check_choice(value, f"{type(self).__name__}.{name}", allow_none=True)
        problem = kinds.field_problem(name, value) if name in kinds.CHECKED_FIELDS else None
        if problem:
            raise ValueError(f"{type(self).__name__}.{problem}")
        super().__setattr__(name, value)

    @property
    def strategy_in_effect(self) -> str:
        """What ``sequence_parallel_input_strategy`` resolves to: None is ``off``, or ``regather`` under
        upstream's flag (:func:`~megatron_bridge_ext.levers.lora_input.config.strategy_in_effect`)."""
        return strategy_in_effect(self)

    @property
    def _log(self) -> logging.Logger:
        return logging.getLogger(type(self).__module__)

    def _bridge_transform(self, module: nn.Module, name: Optional[str], prefix: Optional[str]) -> nn.Module:
        """Bridge's own transform (our LoRA hides upstream's flag from it)."""
        return super().transform(module, name=name, prefix=prefix)

    def _kind_reason(self, wrapper: AdapterWrapper) -> Optional[str]:
        """Why this PEFT kind cannot use a strategy on ``wrapper``, beyond the common rules; None when it can."""
        return None

    def transform(self, module: nn.Module, name: Optional[str] = None, prefix: Optional[str] = None) -> nn.Module:
        already = isinstance(module, AdapterWrapper)
        result = self._bridge_transform(module, name, prefix)
        adapters = [] if already or not isinstance(result, AdapterWrapper) else adapters_of(result)
        if not adapters:
            return result
        strategy = self.strategy_in_effect
        reason = self._kind_reason(result) if strategy != sp_lora.OFF else None
        decisions = decide_wrapper(result, strategy, adapters, reason)
        self._decisions.update((d.adapter, d) for d in decisions)
        decision = decisions[0]
        if decision.eligible:
            enable_sp_input(result, [a for _, a in adapters], decision.strategy)
            self._log.debug("LoRA-A input under SP: %s uses %s", ", ".join(d.adapter for d in decisions),
                            decision.strategy)
        elif strategy != sp_lora.OFF and decision.reason not in _LOGGED_REASONS:
            _LOGGED_REASONS.add(decision.reason)
            self._log.info("LoRA-A input under SP (%s) not used: %s (logged once per reason)", strategy,
                           decision.describe())
        return result

    def __call__(self, model, training: bool = True):
        bridge_truthful_te_detection.PATCH.apply()  # Bridge's TE check must be right before it matches modules
        bridge_lora_te_norm_grad.PATCH.apply()  # adapters left on Bridge's gathered path need it with TE >= 2.4
        result = super().__call__(model, training=training)
        if self.strategy_in_effect != sp_lora.OFF:
            used = sum(d.eligible for d in self._decisions.values())
            self._log.info("LoRA-A input under SP (%s): applied to %d of %d adapters (%s.report() lists each)",
                           self.strategy_in_effect, used, len(self._decisions), type(self).__name__)
        return result

    def report(self) -> list[Decision]:
        """One row per adapter this PEFT created: eligible, strategy, reason and what LoRA-A retains."""
        return list(self._decisions.values())
