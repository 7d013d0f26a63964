"""Bridge's own estimate for the same config, next to ours."""

from __future__ import annotations

import json

import pytest

from tests.support.estimate import DP, QWEN3_8B, TP

pytestmark = [pytest.mark.unit]


def test_bridge_estimate_ignores_peft_where_ours_does_not(qwen_lora):
    from megatron_bridge_ext.estimate.bridge import bridge_estimate

    cfg, est = qwen_lora
    with_lora = bridge_estimate(cfg, data_parallel_size=DP)
    peft, cfg.peft = cfg.peft, None
    try:
        without = bridge_estimate(cfg, data_parallel_size=DP)
    finally:
        cfg.peft = peft
    assert with_lora.total_bytes == without.total_bytes
    # Bridge's count (theoretical_memory_utils.py, _count_parameters and _dense_parameters_on_most_loaded_shard):
    # per layer 2h^2 (1 + g/n) (n d / h) attention, 4h norms, 3 h ffn SwiGLU; a final 2h; the vocabulary's
    # untied embedding and output layer, V h / t each (V unpadded: _get_vocab_size pads only with should_pad_vocab,
    # which GPTModelProvider leaves False, gpt_provider.py:183); the layers over TP; each parameter at 6 + 12 / DP bytes
    # with the distributed optimizer (_bytes_per_parameter), frozen or not.
    hf = _hf(QWEN3_8B)
    h, n, g, d, ffn = (hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                       "intermediate_size"))
    per_layer = 2 * h * h * (n + g) // n * (n * d) // h + 4 * h + 3 * h * ffn
    per_gpu = (hf["num_hidden_layers"] * per_layer + 2 * h) / TP + 2 * hf["vocab_size"] * h / TP
    assert with_lora.components[0] == ("dense parameters and optimizer", round(per_gpu * (6 + 12 / DP)))
    # Ours charges the frozen base its bf16 weight only: the static part is far below Bridge's.
    ours_state = sum(c.bytes for c in est.components if c.kind == "static")
    assert with_lora.components[0][1] > 3 * ours_state


def _hf(path):
    with open(path) as handle:
        return json.load(handle)
