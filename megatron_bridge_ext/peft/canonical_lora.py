"""Drop-in CanonicalLoRA for Megatron Bridge with LoRA-A input under sequence parallelism.

Bridge's ``CanonicalLoRA`` gives ``linear_qkv`` three adapters (q, k, v) and ``linear_fc1`` two (up,
gate), the layout of Hugging Face PEFT checkpoints. Its wrappers hand every adapter of a layer the
same input; under sequence parallelism each of them gathers it for itself on Megatron Core's local
spec (a gathered [s, b, h] copy per adapter: 5 per transformer layer with all five targets), and
they share the gathered norm output under Transformer Engine. ``megatron_bridge_ext.peft.CanonicalLoRA``
keeps the layer's sequence shard instead, one storage for all of the layer's LoRA-A's
(:mod:`megatron_bridge_ext.levers.lora_input.sp_input`): per transformer layer 5*s*b*h becomes
2*s*b*h/t on the local spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge_ext.levers.lora_input.sp_input import SequenceParallelInput  # first: it imports Bridge's PEFT modules

from megatron.bridge.peft.canonical_lora import CanonicalLoRA as BridgeCanonicalLoRA


@dataclass
class CanonicalLoRA(SequenceParallelInput, BridgeCanonicalLoRA):
    """Megatron Bridge's CanonicalLoRA with the LoRA-A input kept sequence-sharded where eligible.

    Accepts every field of Bridge's CanonicalLoRA plus ``sequence_parallel_input_strategy``
    (``"off"``, ``"regather"``, ``"shard_local"``; None is off). Same parameters, state dicts and
    checkpoints as Bridge's. Use it as ``cfg.peft`` or through
    ``+peft._target_=megatron_bridge_ext.peft.CanonicalLoRA`` (import
    :mod:`megatron_bridge_ext.peft.canonical_lora` first, which allowlists the package for Bridge).
    The adapters of one layer are eligible together (:mod:`megatron_bridge_ext.levers.lora_input.eligibility`);
    ``report()`` has a row per adapter (``...linear_qkv.adapter_q``).
    """
