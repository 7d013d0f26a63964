"""The routed experts' offload groups: what the estimate refuses, and the grouped linear stand-in's saves against
Transformer Engine's ``GroupedLinear`` (v2.17.1 ``module/grouped_linear.py`` L550, L620-653). The traced groups
themselves are tested with the offload in ``test_activation_offload.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate.features import expert_offload

pytestmark = [pytest.mark.unit]

ROWS, HIDDEN, OUT = (3, 5, 0, 4), 6, 7


def _model(**fields):
    return SimpleNamespace(**dict(dict(fine_grained_activation_offloading=True, num_moe_experts=8,
                                       moe_grouped_gemm=True, offload_modules=["expert_fc1", "moe_act"]), **fields))


def test_the_groups_are_traced_only_on_grouped_gemm_experts():
    assert expert_offload.used(_model())
    assert not expert_offload.used(_model(moe_grouped_gemm=False))
    assert not expert_offload.used(_model(offload_modules=["core_attn"]))
    assert not expert_offload.used(_model(num_moe_experts=None))
    assert not expert_offload.used(_model(use_transformer_engine_op_fuser=True))  # its forward opens neither


@pytest.mark.parametrize("fields, refused", [
    (dict(), False),
    (dict(fp8="hybrid"), True),
    (dict(fp8="hybrid", moe_grouped_gemm=False), False),  # SequentialMLP opens no group
    (dict(offload_modules=["fused_group_mlp"], use_transformer_engine_op_fuser=True), True),
    (dict(fine_grained_activation_offloading=False, fp8="hybrid"), False),
])
def test_fp8_and_the_fused_group_mlp_are_refused_by_name(fields, refused):
    assert bool(expert_offload.findings(_model(**fields))) == refused


@pytest.mark.parametrize("targets, refused", [
    (["linear_qkv", "linear_proj"], False),
    (["linear_qkv", "linear_fc1"], True),
    (["*.experts.*"], True),
])
def test_adapters_on_the_experts_linears_are_refused_by_name(targets, refused):
    peft = SimpleNamespace(target_modules=targets)
    assert bool(expert_offload.peft_findings(_model(), peft)) == refused
    assert expert_offload.peft_findings(_model(moe_grouped_gemm=False), peft) == []
    assert expert_offload.peft_findings(_model(), None) == []


def _saved(save_original_input: bool, skip_bias_add: bool = False):
    """What the stand-in saves for backward, and its output, on experts of ``ROWS`` rows each."""
    linears = [torch.nn.Linear(HIDDEN, OUT) for _ in ROWS]
    inp = torch.randn(sum(ROWS), HIDDEN, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, biases = expert_offload.GroupedLinearStandIn(linears, skip_bias_add=skip_bias_add,
                                                          save_original_input=save_original_input)(inp, ROWS)
    return inp, linears, saved, out, biases


def test_the_stand_in_saves_the_whole_input_under_save_original_input_else_a_view_per_expert():
    inp, _, saved, _, _ = _saved(save_original_input=True)
    assert [tuple(t.shape) for t in saved] == [(sum(ROWS), HIDDEN)]
    inp, _, saved, _, _ = _saved(save_original_input=False)
    assert [tuple(t.shape) for t in saved] == [(rows, HIDDEN) for rows in ROWS]
    assert {t.untyped_storage().data_ptr() for t in saved} == {inp.untyped_storage().data_ptr()}


@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_the_stand_in_computes_each_experts_linear_and_its_gradients(skip_bias_add):
    inp, linears, _, out, biases = _saved(save_original_input=True, skip_bias_add=skip_bias_add)
    rows = torch.split(inp, ROWS)
    expected = torch.cat([torch.nn.functional.linear(x, m.weight, None if skip_bias_add else m.bias)
                          for x, m in zip(rows, linears)])
    assert out.allclose(expected)
    assert (biases is not None) == skip_bias_add
    out.sum().backward()
    reference = [m.weight.grad.clone() for m in linears]
    for m in linears:
        m.weight.grad = None
    expected.sum().backward()
    assert all(g.allclose(m.weight.grad) for g, m in zip(reference, linears))
