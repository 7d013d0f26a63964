"""Core's and Bridge's refusals of fine-grained activation offloading, one finding per rule, and none for a config
Core accepts (checked against Core's own TransformerConfig where Core raises)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.levers.activation_offload import constraints

pytestmark = [pytest.mark.unit]

GOOD = dict(fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj"], cpu_offloading=False,
            transformer_impl="transformer_engine", activation_offload_fraction=1.0, min_offloaded_tensor_size=0,
            delta_offload_bytes_across_pp_ranks=0, cuda_graph_modules=[], cuda_graph_warmup_steps=0,
            use_transformer_engine_op_fuser=False, num_moe_experts=None)


def _settings(finding_list):
    return [f.setting for f in finding_list]


def test_an_accepted_config_and_the_offload_off_raise_nothing():
    assert constraints.findings(SimpleNamespace(**GOOD)) == []
    assert constraints.findings(SimpleNamespace(**dict(GOOD, fine_grained_activation_offloading=False,
                                                       offload_modules=["attn_proj"]))) == []


@pytest.mark.parametrize("change, setting", [
    (dict(cpu_offloading=True), "model.cpu_offloading"),
    (dict(transformer_impl="local"), "model.transformer_impl"),
    (dict(offload_modules=[]), "model.offload_modules"),
    (dict(offload_modules=["core_attn", "mlp"]), "model.offload_modules"),
    (dict(offload_modules=["attn_proj"]), "model.offload_modules"),
    (dict(offload_modules=["fused_group_mlp"]), "model.offload_modules"),
    (dict(offload_modules=["fused_group_mlp", "moe_act"], use_transformer_engine_op_fuser=True),
     "model.offload_modules"),
    (dict(offload_modules=["moe_act"], moe_paged_stash=True), "model.offload_modules"),
    (dict(activation_offload_fraction=1.5), "model.activation_offload_fraction"),
    (dict(min_offloaded_tensor_size=-1), "model.min_offloaded_tensor_size"),
    (dict(delta_offload_bytes_across_pp_ranks=-1), "model.delta_offload_bytes_across_pp_ranks"),
    (dict(cuda_graph_modules=["attn"]), "model.cuda_graph_warmup_steps"),
])
def test_each_rule_is_one_finding(change, setting):
    assert _settings(constraints.findings(SimpleNamespace(**dict(GOOD, **change)))) == [setting]


@pytest.mark.parametrize("change", [
    dict(cpu_offloading=True), dict(offload_modules=["attn_proj"]), dict(offload_modules=["core_attn", "mlp"]),
    dict(activation_offload_fraction=1.5), dict(min_offloaded_tensor_size=-1),
    dict(offload_modules=["fused_group_mlp"]),
])
def test_what_is_refused_core_refuses_too(change):
    """Core's TransformerConfig raises (assert or ValueError) on each Core rule the module names."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {k: v for k, v in dict(GOOD, **change).items() if k != "transformer_impl"}
    with pytest.raises((AssertionError, ValueError)):
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **fields)
    assert constraints.findings(SimpleNamespace(**dict(GOOD, **change)))
