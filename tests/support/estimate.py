"""What the estimate tests share: the public model shape they read, the layout of its LoRA estimate, and the
parameter counts of one layer and its LoRA adapters by hand from a config.json."""

from __future__ import annotations

import os

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
QWEN3_8B = os.path.join(DATA, "qwen3-8b", "config.json")
TP, SEQ, DP, RANK = 2, 8192, 4, 16


def layer_params(hf: dict, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank: column/row-parallel linears split by TP,
    norms (and Qwen3's q/k norms) replicated."""
    h, n, g, ffn = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"]
    d = hf.get("head_dim", h // n)
    qkv = (n + 2 * g) * d * h // tp
    proj = n * d * h // tp
    fc1 = 2 * ffn * h // tp  # gate and up (SwiGLU)
    fc2 = ffn * h // tp
    norms = 2 * h + (2 * d if hf["model_type"] == "qwen3" else 0)
    return qkv + proj + fc1 + fc2 + norms


def adapter_params(hf: dict, tp: int, rank: int) -> int:
    """Bridge LoRA on qkv, proj, fc1, fc2: rank x (in + out) per target, split by TP (A on the rank
    dimension for column targets, on the input for row targets; B on the output)."""
    h, n, g, ffn = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"]
    d = hf.get("head_dim", h // n)
    in_out = (h + (n + 2 * g) * d) + (n * d + h) + (h + 2 * ffn) + (ffn + h)
    return rank * in_out // tp


def assert_reduced_equals_whole(cfg, monkeypatch, **options) -> None:
    """The estimate traced with a reduced set of layers equals the one that traces every layer, figure for figure
    (``options``: :func:`megatron_bridge_ext.estimate.estimate`'s)."""
    from megatron_bridge_ext.estimate import memory

    fast = memory.estimate(cfg, **options)
    monkeypatch.setattr(memory, "traced_layers", lambda provider, stage=0: None)
    whole = memory.estimate(cfg, **options)
    assert fast.stage_peaks == whole.stage_peaks
    assert fast.activations_per_microbatch == whole.activations_per_microbatch
    assert fast.activations_per_layer == whole.activations_per_layer
    assert [(c.name, c.bytes) for c in fast.components] == [(c.name, c.bytes) for c in whole.components]
