"""Recipe functions for ``mbx plan --recipe`` tests: Bridge's vanilla GPT recipe, which runs offline, as a
recipe that sets ``cfg.peft`` itself (as Bridge's ``*_peft_config`` recipes do)."""

from __future__ import annotations

LORA_DIM, LORA_ALPHA, LORA_TARGETS = 8, 16, ["linear_qkv", "linear_proj", "linear_fc1"]


def vanilla_gpt_with_lora():
    """Bridge's vanilla GPT recipe with Bridge's own LoRA set in Python."""
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config

    cfg = vanilla_gpt_pretrain_config()
    cfg.peft = LoRA(dim=LORA_DIM, alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS))
    return cfg
