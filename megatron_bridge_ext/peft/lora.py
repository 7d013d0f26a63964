"""Drop-in LoRA for Megatron Bridge with LoRA-A input under sequence parallelism.

``megatron_bridge_ext.peft.LoRA`` accepts every field of Bridge's ``LoRA`` plus:

* ``sequence_parallel_input_regather`` — upstream's flag (Bridge >= 0.6), also on Bridge releases
  that lack it; served by our own regather implementation.
* ``sequence_parallel_input_strategy`` — ``"regather"`` or ``"shard_local"`` (None: ``"regather"``
  when the flag is set, otherwise off).

Bridge builds every adapter exactly as it always does (same parameters, names, shapes, TP
attributes, checkpoints). For each eligible column-parallel adapter we then (1) stop the adapter
from gathering its input along the sequence (``disable_sequence_parallel_comm``) — with TE, the
fused LayerNorm returns its local output instead of the gathered one — and (2) let LoRA-A's
``ColumnParallelLinear`` run one of our autograd functions from :mod:`.sp_lora` on the local
shard, by giving the module a subclass that overrides only ``forward``. Everything after LoRA-A
(activation, dropout, LoRA-B, scaling) stays Bridge's code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from megatron_bridge_ext.patches import bridge_lora_te_norm_grad, bridge_peft_without_te, bridge_truthful_te_detection

bridge_peft_without_te.import_bridge_peft()

from megatron.bridge.peft.lora import LoRA as BridgeLoRA  # noqa: E402
from megatron.bridge.peft.lora_layers import LoRALinear  # noqa: E402
from megatron.bridge.peft.utils import ParallelLinearAdapter  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)

from megatron_bridge_ext.peft import sp_lora  # noqa: E402
from megatron_bridge_ext.peft.eligibility import Decision, decide, is_te_layernorm_linear  # noqa: E402

logger = logging.getLogger(__name__)


class SequenceParallelLoRAIn(ColumnParallelLinear):
    """LoRA-A that consumes the local sequence shard [s/t, b, h] and returns the full [s, b, r] input of LoRA-B.

    Same parameters and state as the ColumnParallelLinear it replaces (only ``forward`` differs);
    ``_mbx_strategy`` names the strategy in :data:`megatron_bridge_ext.peft.sp_lora.STRATEGIES`.
    When LoRA-A is frozen nothing needs its input for a weight gradient, so it falls back to the
    gathered path, which then retains nothing.
    """

    _mbx_strategy: str = sp_lora.REGATHER

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        if not weight.requires_grad:
            gathered = gather_from_sequence_parallel_region(input_, group=self.tp_group)
            return gather_from_tensor_model_parallel_region(gathered.matmul(weight.t()), group=self.tp_group), None
        strategy = sp_lora.STRATEGIES[self._mbx_strategy]
        return strategy.output(input_, weight, self.tp_group, bool(self.gradient_accumulation_fusion)), None


def _check_not_conflicting(upstream_flag: bool, strategy) -> None:
    """Upstream's flag asks for regather; a different explicit strategy is a contradiction, not a choice."""
    if upstream_flag and strategy not in (None, sp_lora.REGATHER):
        raise ValueError(
            f"LoRA.sequence_parallel_input_regather=True asks for regather but sequence_parallel_input_strategy="
            f"{strategy!r} asks for another. Fix: drop sequence_parallel_input_regather (the strategy decides), "
            "or set sequence_parallel_input_strategy='regather'")


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


def enable_sp_input(lora_linear: LoRALinear, strategy: str) -> None:
    """Switch one Bridge adapter to the sequence-local LoRA-A input (no new parameters)."""
    adapter = lora_linear.adapter
    adapter.disable_sequence_parallel_comm = True
    if is_te_layernorm_linear(lora_linear.to_wrap):
        lora_linear.to_wrap.return_layernorm_output_gathered = False
    adapter.linear_in.__class__ = SequenceParallelLoRAIn
    adapter.linear_in._mbx_strategy = strategy


@dataclass
class LoRA(BridgeLoRA):
    """Megatron Bridge's LoRA with the LoRA-A input kept sequence-sharded where eligible.

    Accepts every field of Bridge's LoRA. Use it as ``cfg.peft``, or create it with Bridge's
    overrides where ``cfg.peft`` is None (``+peft._target_=megatron_bridge_ext.peft.LoRA
    +peft.sequence_parallel_input_strategy=shard_local``; Bridge keeps an existing PEFT object out
    of its override config, so overrides cannot change one). Bridge instantiates ``_target_`` only
    from allowlisted packages: importing this module adds ``megatron_bridge_ext``, so import it
    before Bridge processes such an override or loads a saved run config. See the module docstring
    for the two fields it adds and :mod:`megatron_bridge_ext.peft.eligibility` for when an adapter
    is eligible.
    """

    sequence_parallel_input_regather: bool = False
    sequence_parallel_input_strategy: Optional[str] = None
    """``"off"``, ``"regather"`` or ``"shard_local"``; None: ``"regather"`` when the upstream flag is set, else off."""

    def __post_init__(self) -> None:
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        self._decisions: dict[str, Decision] = {}
        self._logged_reasons: set[str] = set()

    def __setattr__(self, name: str, value) -> None:
        # Checked on every assignment, not only in __init__: Bridge's config overrides set fields
        # of an existing object, and an unknown strategy must not silently run as another one.
        if name == "sequence_parallel_input_strategy":
            sp_lora.check_choice(value, "LoRA.sequence_parallel_input_strategy", allow_none=True)
            _check_not_conflicting(getattr(self, "sequence_parallel_input_regather", False), value)
        elif name == "sequence_parallel_input_regather":
            if not isinstance(value, bool):
                raise ValueError(f"LoRA.sequence_parallel_input_regather={value!r} is not a bool. Fix: write True "
                                 "or False")
            _check_not_conflicting(value, getattr(self, "sequence_parallel_input_strategy", None))
        super().__setattr__(name, value)

    @property
    def strategy(self) -> str:
        """The strategy in effect: the explicit one, else ``regather`` when the upstream flag is set, else ``off``."""
        if self.sequence_parallel_input_strategy is not None:
            return self.sequence_parallel_input_strategy
        return sp_lora.REGATHER if self.sequence_parallel_input_regather else sp_lora.OFF

    def transform(self, module: nn.Module, name: Optional[str] = None, prefix: Optional[str] = None) -> nn.Module:
        already = isinstance(module, LoRALinear)
        upstream_flag = getattr(self, "sequence_parallel_input_regather", False)
        # Bridge must build its default (gathered) adapter; the sequence-local input is ours.
        if upstream_flag:
            object.__setattr__(self, "sequence_parallel_input_regather", False)
        try:
            result = super().transform(module, name=name, prefix=prefix)
        finally:
            if upstream_flag:
                object.__setattr__(self, "sequence_parallel_input_regather", True)
        if already or not isinstance(result, LoRALinear) or not isinstance(result.adapter, ParallelLinearAdapter):
            return result
        full_name = result.adapter.base_linear_name
        decision = decide(result, self.strategy)
        self._decisions[full_name] = decision
        if decision.eligible:
            enable_sp_input(result, decision.strategy)
            logger.debug("LoRA-A input under SP: %s uses %s", full_name, decision.strategy)
        elif self.strategy != sp_lora.OFF and decision.reason not in self._logged_reasons:
            self._logged_reasons.add(decision.reason)
            logger.info("LoRA-A input under SP (%s): %s keeps the gathered input: %s (logged once per reason)",
                        self.strategy, full_name, decision.reason)
        return result

    def __call__(self, model, training: bool = True):
        bridge_truthful_te_detection.PATCH.apply()  # Bridge's TE check must be right before it matches modules
        bridge_lora_te_norm_grad.PATCH.apply()  # adapters left on Bridge's gathered path need it with TE >= 2.4
        result = super().__call__(model, training=training)
        if self.strategy != sp_lora.OFF:
            used = sum(d.eligible for d in self._decisions.values())
            logger.info("LoRA-A input under SP (%s): applied to %d of %d adapters (LoRA.report() lists each)",
                        self.strategy, used, len(self._decisions))
        return result

    def report(self) -> list[Decision]:
        """One row per adapter this LoRA created: eligible, strategy and reason."""
        return list(self._decisions.values())
