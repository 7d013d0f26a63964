"""PEFT: the drop-in LoRA with LoRA-A input under sequence parallelism.

``import megatron_bridge_ext.peft`` imports nothing else. Accessing ``LoRA`` (or
``SequenceParallelLoRAIn``) imports Megatron Bridge's PEFT modules (on a machine without
Transformer Engine through the ``bridge_peft_without_te`` import hook, installed for that import
only). The autograd core in :mod:`.sp_lora` imports only torch and Megatron Core.
"""


def __getattr__(name):
    if name in ("LoRA", "SequenceParallelLoRAIn"):
        from megatron_bridge_ext.peft import lora

        return getattr(lora, name)
    raise AttributeError(name)
