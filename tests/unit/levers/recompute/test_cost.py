"""What recompute costs in the plan (the forward FLOPs it repeats), and resizing TP (the activation traffic), derived from the shapes."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.levers.parallelism import cost as parallelism_cost
from megatron_bridge_ext.levers.recompute import cost as recompute_cost

pytestmark = [pytest.mark.unit]


def test_recompute_flops_and_tp_traffic_formulas():
    s = {"seq_length": 1024, "micro_batch": 2, "hidden": 64, "tp": 2, "heads": 8, "kv_channels": 8, "ffn": 256,
         "gated_linear_unit": True, "sequence_parallel": True}
    # Attention: Q K^T and probabilities x V, 2 FLOPs per multiply-add, 4 heads per rank.
    assert recompute_cost.recompute_flops_per_layer("core_attn", s) == 2 * (2 * 2 * 1024 * 1024 * 4 * 8)
    # MLP: fc1 (2 x 128 outputs per rank with SwiGLU) and fc2 (128 inputs per rank).
    assert recompute_cost.recompute_flops_per_layer("mlp", s) == 2 * 2 * 1024 * 64 * 256 + 2 * 2 * 1024 * 128 * 64
    assert parallelism_cost.tp_collective_bytes(s, tp=1, layers=4, num_microbatches=2, element=2) == 0
    assert parallelism_cost.tp_collective_bytes(s, tp=2, layers=4, num_microbatches=2, element=2) \
        == 8 * 1024 * 2 * 64 * 2 // 2 * 4 * 2
