"""The Qwen3-8B LoRA estimate that the estimate tests and the Bridge-estimate test read (built once per module)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate import configs
from tests.support.estimate import DP, QWEN3_8B, RANK, SEQ, TP


@pytest.fixture(scope="module")
def qwen_lora():
    layout = configs.Layout(tp=TP, seq=SEQ, dp=DP, peft="lora", lora_dim=RANK, lora_alpha=32)
    cfg = configs.from_hf_config(QWEN3_8B, layout)
    from megatron_bridge_ext.estimate import estimate

    return cfg, estimate(cfg)
