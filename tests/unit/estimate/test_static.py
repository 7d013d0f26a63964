"""The optimizer-state rules of the static estimate."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate.static import optimizer_rule

pytestmark = [pytest.mark.unit]


def test_optimizer_rules():
    class Adam:
        optimizer, use_precision_aware_optimizer, use_distributed_optimizer = "adam", False, True

    assert optimizer_rule(Adam, param_bytes=2, data_parallel=8, context_parallel=1).bytes_per_parameter == 12
    assert optimizer_rule(Adam, param_bytes=2, data_parallel=8, context_parallel=2).shards == 16
    assert optimizer_rule(Adam, param_bytes=4, data_parallel=1, context_parallel=1).bytes_per_parameter == 8

    import torch

    class PrecisionAware(Adam):
        use_precision_aware_optimizer = True
        main_params_dtype, exp_avg_dtype, exp_avg_sq_dtype = torch.float32, torch.bfloat16, torch.bfloat16

    assert optimizer_rule(PrecisionAware, param_bytes=2, data_parallel=1, context_parallel=1).bytes_per_parameter == 8

    class SGD(Adam):
        optimizer, use_distributed_optimizer = "sgd", False

    rule = optimizer_rule(SGD, param_bytes=2, data_parallel=4, context_parallel=1)
    assert (rule.bytes_per_parameter, rule.shards) == (8, 1)


@pytest.mark.parametrize("name, part", [
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", "experts"),
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.adapter.linear_in.weight", "expert adapters"),
    ("decoder.layers.0.mlp.router.weight", "transformer layers"),
    ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "transformer layers"),
    ("decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight", "adapters"),
])
def test_routed_experts_are_their_own_part_router_and_shared_experts_stay_in_the_layers(name, part):
    from megatron_bridge_ext.estimate.static import part_of

    assert part_of(name) == part
