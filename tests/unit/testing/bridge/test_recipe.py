"""The tiny Bridge recipe's MoE variant changes the model's MoE fields and nothing else, to a layout Core accepts."""

import copy
import dataclasses
import types

import pytest

from megatron_bridge_ext.testing.bridge import recipe

pytestmark = pytest.mark.unit

MOE_FIELDS = {"num_moe_experts": recipe.EXPERTS, "moe_router_topk": recipe.MOE_TOPK,
              "moe_ffn_hidden_size": recipe.MOE_FFN, "moe_grouped_gemm": False,
              "moe_token_dispatcher_type": "allgather",
              "expert_model_parallel_size": recipe.EXPERT_PARALLEL,
              "expert_tensor_parallel_size": recipe.EXPERT_TENSOR_PARALLEL}


def _fields(model) -> dict:
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}


def test_with_experts_sets_the_moe_fields_and_leaves_every_other_field_as_it_was():
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()  # megatron.bridge's package import reaches its PEFT modules
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    dense = GPTModelProvider()
    cfg = types.SimpleNamespace(model=copy.deepcopy(dense))
    assert recipe.with_experts(cfg) is cfg
    before, after = _fields(dense), _fields(cfg.model)
    changed = {name: after[name] for name in after if after[name] != before[name]}
    assert changed == {name: value for name, value in MOE_FIELDS.items() if before[name] != value}
    assert before["num_moe_experts"] is None  # so the MoE fields did change the model


def test_the_moe_recipe_layout_is_one_megatron_core_accepts():
    from megatron_bridge_ext.levers.parallelism.constraints import expert_layout_problem

    names = {"ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size", "dp": "data parallel"}
    assert expert_layout_problem(ep=recipe.EXPERT_PARALLEL, etp=recipe.EXPERT_TENSOR_PARALLEL,
                                 tp=recipe.TENSOR_PARALLEL, cp=1, dp=1, experts=recipe.EXPERTS, names=names) is None
