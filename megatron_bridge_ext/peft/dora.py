"""Drop-in DoRA for Megatron Bridge with LoRA-A input under sequence parallelism.

``megatron_bridge_ext.peft.DoRA`` accepts every field of Bridge's ``DoRA`` plus
``sequence_parallel_input_strategy``, applied as for our LoRA
(:mod:`megatron_bridge_ext.levers.lora_input.sp_input`). Bridge's ``DoRALinear`` runs unchanged: it feeds LoRA-A the base layer's input (the LayerNorm output) as
LoRA does, and scales base plus adapter output by m / ||W_0 + s*B*A|| (row norms). Those magnitude
terms read weights only (LoRA-A's shards all-gathered over TP), never the input, so they put no
condition on how LoRA-A gets it.

The dropout correction does. With dropout > 0, in training, ``DoRALinear.forward`` forms
(m/||W|| - 1) * W_0 (dropout(x) - x) by calling the wrapped base layer a second time, on
``dropout(layernorm_output) - layernorm_output``. That is W_0 applied to it when the base is a
plain linear (Megatron Core's ColumnParallelLinear, the local spec), which gets the sequence shard
in Bridge's path and in ours alike. A Transformer Engine LayerNormColumnParallelLinear applies its
LayerNorm again to that norm output; under sequence parallelism Bridge hands it the gathered
[s, b, h] norm output, which the layer gathers once more, and the sum then fails on mismatched
sequence lengths. Our strategies would hand it the shard: the shapes would agree and the wrong
correction would pass silently. So there (dropout > 0 on a TE LayerNorm-linear) our DoRA leaves the
adapter on Bridge's path, and ``report()`` says why: Bridge's behaviour, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from megatron_bridge_ext.levers.lora_input.eligibility import is_te_layernorm_linear
from megatron_bridge_ext.levers.lora_input.sp_input import SequenceParallelInput  # first: it imports Bridge's PEFT modules

from megatron.bridge.peft.dora import DoRA as BridgeDoRA

TE_DROPOUT_REASON = ("Bridge's DoRA dropout correction runs the TE LayerNorm-linear again on its own norm output "
                     "(set dropout=0.0 to keep LoRA-A's input sharded here)")


@dataclass
class DoRA(SequenceParallelInput, BridgeDoRA):
    """Megatron Bridge's DoRA with the LoRA-A input kept sequence-sharded where eligible.

    Accepts every field of Bridge's DoRA plus ``sequence_parallel_input_strategy`` (``"off"``,
    ``"regather"``, ``"shard_local"``; None is off). Same parameters (``weight_magnitude`` included),
    state dicts and checkpoints as Bridge's. Use it as ``cfg.peft`` or through
    ``+peft._target_=megatron_bridge_ext.peft.DoRA`` (import :mod:`megatron_bridge_ext.peft.dora`
    first, which allowlists the package for Bridge). Eligibility is our LoRA's
    (:mod:`megatron_bridge_ext.levers.lora_input.eligibility`), plus the dropout rule of the module docstring.
    """

    def _kind_reason(self, wrapper) -> Optional[str]:
        dropout = getattr(wrapper.adapter, "dropout", None)
        if dropout is not None and not isinstance(dropout, nn.Identity) and is_te_layernorm_linear(wrapper.to_wrap):
            return TE_DROPOUT_REASON
        return None
