"""Megatron Core's expert-parallel layout rules (``megatron_bridge_ext/levers/parallelism/constraints.py``)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.levers.parallelism import constraints

pytestmark = [pytest.mark.unit]

EXPERT_LAYOUTS = [
    # (tp, cp, dp, ep, etp, experts, bias) -> accepted by Core's rules
    ((4, 1, 4, 4, 4, 128, False), True),      # 16 GPUs per stage = ETP 4 x EP 4
    ((4, 1, 2, 4, 4, 128, False), False),     # 8 GPUs, a 16-GPU expert grid
    ((4, 1, 1, 4, 1, 128, False), True),      # ETP 1: 4 GPUs = 1 x 4
    ((4, 1, 1, 4, None, 128, False), True),   # unset ETP with EP > 1: 1 (Bridge's finalize)
    ((2, 1, 1, 4, None, 128, False), False),  # 2 GPUs, a grid of 1 x 4
    ((2, 2, 2, 8, 1, 128, False), True),      # CP counts: 8 GPUs = 1 x 8
    ((2, 1, 2, 8, 1, 128, False), False),     # without CP, 4 GPUs
    ((1, 1, 8, 8, None, 60, False), False),   # 8 does not divide 60 experts
    ((1, 1, 4, 4, None, 60, False), True),
    ((2, 1, 2, 2, 2, 128, True), False),      # MoE bias needs ETP 1
    ((2, 1, 2, 1, None, 128, True), False),   # unset ETP with EP 1: TP's 2
    ((2, 1, 2, 2, None, 128, True), True),    # unset ETP with EP 2: 1
    ((1, 1, 2, 2, None, None, False), False),  # EP without experts
    ((8, 1, 1, 1, None, None, False), True),   # a dense model: ETP = TP divides TP x CP x DP
]


@pytest.mark.parametrize("sizes, accepted", EXPERT_LAYOUTS, ids=[str(s) for s, _ in EXPERT_LAYOUTS])
def test_expert_layout_rules(sizes, accepted):
    tp, cp, dp, ep, etp, experts, bias = sizes
    problem = constraints.expert_layout_problem(ep=ep, etp=etp, tp=tp, cp=cp, dp=dp, experts=experts, bias=bias,
                                               names={"ep": "--ep", "etp": "--etp", "dp": "--dp"})
    assert (problem is None) is accepted, problem


@pytest.mark.parametrize("fields, expected", [
    ({"tensor_model_parallel_size": 4}, (1, 4)),  # dense: EP 1, ETP = TP (Core's default)
    ({"tensor_model_parallel_size": 4, "expert_model_parallel_size": 8}, (8, 1)),  # Bridge's default with EP > 1
    ({"tensor_model_parallel_size": 4, "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 2}, (4, 2)),
    ({"tensor_model_parallel_size": 2, "expert_model_parallel_size": None}, (1, 2)),
], ids=["dense", "ep-unset-etp", "both-set", "ep-none"])
def test_expert_sizes_fill_in_what_core_and_bridge_fill_in(fields, expected):
    import types

    assert constraints.expert_sizes(types.SimpleNamespace(**fields)) == expected
