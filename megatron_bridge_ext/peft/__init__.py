"""PEFT: drop-in LoRA, DoRA and CanonicalLoRA with LoRA-A input under sequence parallelism.

``import megatron_bridge_ext.peft`` imports nothing else. Accessing ``LoRA``, ``DoRA`` or
``CanonicalLoRA`` imports Megatron Bridge's PEFT modules (on a machine without Transformer
Engine through the ``bridge_peft_without_te`` import hook, installed for that import only). The strategies themselves live in :mod:`megatron_bridge_ext.levers.lora_input`.
"""

_LAZY = {"LoRA": "lora", "DoRA": "dora", "CanonicalLoRA": "canonical_lora"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"megatron_bridge_ext.peft.{_LAZY[name]}"), name)
    raise AttributeError(name)
