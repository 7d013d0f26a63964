"""Drop-in LoRA for Megatron Bridge with LoRA-A input under sequence parallelism.

``megatron_bridge_ext.peft.LoRA`` accepts every field of Bridge's ``LoRA`` plus:

* ``sequence_parallel_input_regather`` — upstream's flag (Bridge >= 0.6), also on Bridge releases
  that lack it; served by our own regather implementation.
* ``sequence_parallel_input_strategy`` — ``"regather"`` or ``"shard_local"`` (None: ``"regather"``
  when the flag is set, otherwise off).

How the strategy is applied (the same for our DoRA and CanonicalLoRA) is in
:mod:`megatron_bridge_ext.levers.lora_input.sp_input`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from megatron_bridge_ext.levers.lora_input import sp_lora
from megatron_bridge_ext.levers.lora_input.sp_input import SequenceParallelInput  # first: it imports Bridge's PEFT modules

from megatron.bridge.peft.lora import LoRA as BridgeLoRA  # noqa: E402


def _check_not_conflicting(upstream_flag: bool, strategy) -> None:
    """Upstream's flag asks for regather; a different explicit strategy is a contradiction, not a choice."""
    if upstream_flag and strategy not in (None, sp_lora.REGATHER):
        raise ValueError(
            f"LoRA.sequence_parallel_input_regather=True asks for regather but sequence_parallel_input_strategy="
            f"{strategy!r} asks for another. Fix: drop sequence_parallel_input_regather (the strategy decides), "
            "or set sequence_parallel_input_strategy='regather'")


@dataclass
class LoRA(SequenceParallelInput, BridgeLoRA):
    """Megatron Bridge's LoRA with the LoRA-A input kept sequence-sharded where eligible.

    Accepts every field of Bridge's LoRA. Use it as ``cfg.peft``, or create it with Bridge's
    overrides where ``cfg.peft`` is None (``+peft._target_=megatron_bridge_ext.peft.LoRA
    +peft.sequence_parallel_input_strategy=shard_local``; Bridge keeps an existing PEFT object out
    of its override config, so overrides cannot change one). Bridge instantiates ``_target_`` only
    from allowlisted packages: importing this module adds ``megatron_bridge_ext``, so import it
    before Bridge processes such an override or loads a saved run config. When Bridge cannot build
    it (a misspelt strategy), Bridge logs that and leaves a dict in ``cfg.peft``;
    ``MemoryConfig.validate`` and ``mbx plan`` refuse that dict with this class's error. See the module docstring
    for the two fields it adds and :mod:`megatron_bridge_ext.levers.lora_input.eligibility` for when an adapter
    is eligible.
    """

    sequence_parallel_input_regather: bool = False

    def __setattr__(self, name: str, value) -> None:
        # Upstream's flag and our strategy are checked against each other on every assignment.
        if name == "sequence_parallel_input_strategy":
            sp_lora.check_choice(value, "LoRA.sequence_parallel_input_strategy", allow_none=True)
            _check_not_conflicting(getattr(self, "sequence_parallel_input_regather", False), value)
        elif name == "sequence_parallel_input_regather":
            if not isinstance(value, bool):
                raise ValueError(f"LoRA.sequence_parallel_input_regather={value!r} is not a bool. Fix: write True "
                                 "or False")
            _check_not_conflicting(value, getattr(self, "sequence_parallel_input_strategy", None))
        super().__setattr__(name, value)

    def _bridge_transform(self, module: nn.Module, name: Optional[str], prefix: Optional[str]) -> nn.Module:
        # Bridge must build its default (gathered) adapter; the sequence-local input is ours.
        upstream_flag = getattr(self, "sequence_parallel_input_regather", False)
        if upstream_flag:
            object.__setattr__(self, "sequence_parallel_input_regather", False)
        try:
            return super()._bridge_transform(module, name, prefix)
        finally:
            if upstream_flag:
                object.__setattr__(self, "sequence_parallel_input_regather", True)
