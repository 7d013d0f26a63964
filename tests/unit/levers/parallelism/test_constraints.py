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


@pytest.mark.parametrize("pp, vpp, microbatches, group, refused", [
    (4, None, 1, None, None),  # 1F1B takes any count
    (1, 2, 8, None, "without pipeline parallelism"),
    (4, 2, 3, None, "runs them in groups of 4"),  # fewer microbatches than PP
    (4, 2, 4, None, None),  # exactly PP
    (4, 2, 6, None, "leaving a last group of 2"),  # 6 % 4 = 2 < PP
    (4, 2, 8, None, None),
    (4, 2, 10, 5, None),  # groups of 5: 10 % 5 = 0
    (4, 2, 9, 5, None),  # last group of 4 = PP
    (4, 2, 8, 5, "leaving a last group of 3"),
    (4, 2, 8, 3, "runs them in groups of 3"),  # a group below PP
], ids=["1f1b", "vpp-without-pp", "fewer-than-pp", "exactly-pp", "remainder-below-pp", "multiple", "group-5",
        "remainder-equal-pp", "remainder-3-of-group-5", "group-below-pp"])
def test_the_interleaved_schedule_takes_only_what_core_takes(pp, vpp, microbatches, group, refused):
    """Megatron Core 0.19: parallel_state.initialize_model_parallel L827-831 (VPP needs PP > 1) and
    forward_backward_pipelining_with_interleaving, schedules.py L1133-1152 (group in [PP, M]; M % group is 0 or
    at least PP)."""
    from megatron_bridge_ext.levers.parallelism.constraints import schedule_findings

    findings = schedule_findings(pp=pp, vpp=vpp, num_microbatches=microbatches, group=group)
    if refused is None:
        assert findings == []
    else:
        (finding,) = findings
        assert refused in finding.message
