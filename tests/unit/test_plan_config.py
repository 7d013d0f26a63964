"""The rules of the config ``mbx plan`` builds that its checks share before the build: which setting an error
names, the global batch against micro-batch x DP, the expert-only flags (no Bridge: the build itself is tested
through the command, ``tests/unit/cli/test_plan*.py``)."""

from __future__ import annotations

from argparse import Namespace

import pytest

from megatron_bridge_ext import plan_config

pytestmark = [pytest.mark.unit]


def _args(**given) -> Namespace:
    return Namespace(**{"recipe": None, "overrides": [], "ep": None, "etp": None, "moe_imbalance": None, **given})


def test_an_error_names_the_override_that_sets_the_size_else_the_recipes_field_else_the_flag():
    field = plan_config.EXPERT_FIELDS["ep"]
    assert plan_config.written(_args(ep=4), "ep") == "--ep"
    assert plan_config.written(_args(ep=4, overrides=[f"+{field}=8"]), "ep") == field
    assert plan_config.written(_args(recipe="m:f"), "ep") == field  # the recipe may have set it
    assert plan_config.written(_args(recipe="m:f", ep=4), "ep") == "--ep"


@pytest.mark.parametrize("global_batch, micro_batch, dp", [(12, 2, 4), (100, 1, 8)])
def test_a_global_batch_that_is_no_multiple_of_micro_batch_x_dp_is_refused_with_the_nearest_multiple(
        global_batch, micro_batch, dp):
    unit = micro_batch * dp
    problem = plan_config.global_batch_problem(global_batch, micro_batch, dp, setting="--global-batch")
    assert problem.setting == "--global-batch"
    assert f"micro-batch x DP = {micro_batch} x {dp} = {unit}" in problem.message
    assert problem.fix == f"give a multiple of {unit}, e.g. --global-batch {unit * round(global_batch / unit)}"
    assert plan_config.global_batch_problem(unit * 3, micro_batch, dp, setting="--global-batch") is None
    override = plan_config.global_batch_problem(global_batch, micro_batch, dp, setting="train.global_batch_size")
    assert override.fix.endswith(f"train.global_batch_size={unit * round(global_batch / unit)}")


def test_an_expert_only_flag_on_a_model_without_experts_is_refused_by_name():
    for name, flag in plan_config.EXPERT_ONLY_FLAGS.items():
        problem = plan_config.expert_flag_problem(_args(**{name: 2}), experts=None)
        assert problem.setting == flag and problem.fix == f"drop {flag}"
        assert plan_config.expert_flag_problem(_args(**{name: 2}), experts=8) is None
    assert plan_config.expert_flag_problem(_args(), experts=0) is None
