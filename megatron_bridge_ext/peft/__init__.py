"""PEFT: the drop-in LoRA with LoRA-A input under sequence parallelism.

``from megatron_bridge_ext.peft import LoRA`` imports Megatron Bridge (patched where needed);
the autograd core in :mod:`.sp_lora` imports only torch and Megatron Core.
"""


def __getattr__(name):
    if name in ("LoRA", "SequenceParallelLoRAIn"):
        from megatron_bridge_ext.peft import lora

        return getattr(lora, name)
    raise AttributeError(name)
