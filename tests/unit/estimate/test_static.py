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


def _counts(trainable_layers: int, frozen_layers: int, trainable_experts: int = 0):
    from megatron_bridge_ext.estimate.static import ParameterCounts, PARTS

    frozen = dict.fromkeys(PARTS, 0)
    trainable = dict.fromkeys(PARTS, 0)
    frozen["transformer layers"], trainable["adapters"] = frozen_layers, trainable_layers
    trainable["experts"] = trainable_experts
    return ParameterCounts(frozen, trainable, element_size=2)


def test_the_distributed_optimizer_divides_the_states_over_dp_x_cp_rounding_up():
    """bf16 Adam: 12 B per trainable parameter (fp32 main copy and two fp32 moments), divided over DP x CP by the
    distributed optimizer (Core's DistributedOptimizer shards its buffers over the data-parallel group with CP),
    a rank's share rounded up; frozen parameters carry none; gradients are never divided."""
    from megatron_bridge_ext.estimate.static import optimizer_rule, static_components

    class Adam:
        optimizer, use_precision_aware_optimizer, use_distributed_optimizer = "adam", False, True

    trainable = 1_000_003  # not a multiple of 8: the share rounds up
    counts = _counts(trainable, frozen_layers=7_000_000)
    rule = optimizer_rule(Adam, param_bytes=2, data_parallel=4, context_parallel=2)
    parts = {c.name: c.bytes for c in static_components(counts, grad_bytes=4, rule=rule)}
    assert parts["optimizer states"] == -(-trainable * 12 // 8) == 1_500_005
    assert parts["gradients (main_grad buffer)"] == trainable * 4
    assert parts["weights: transformer layers"] == 7_000_000 * 2 and parts["weights: adapters"] == trainable * 2

    class Replicated(Adam):
        use_distributed_optimizer = False

    rule = optimizer_rule(Replicated, param_bytes=2, data_parallel=4, context_parallel=2)
    parts = {c.name: c.bytes for c in static_components(counts, grad_bytes=4, rule=rule)}
    assert parts["optimizer states"] == trainable * 12


def test_trainable_experts_divide_their_states_over_expert_dp_the_rest_over_dp():
    from megatron_bridge_ext.estimate.static import expert_data_parallel, optimizer_rule, static_components

    class Adam:
        optimizer, use_precision_aware_optimizer, use_distributed_optimizer = "adam", False, True

    dense, experts = 4_000, 64_000
    counts = _counts(dense, frozen_layers=0, trainable_experts=experts)
    rule = optimizer_rule(Adam, param_bytes=2, data_parallel=8, context_parallel=1)
    # 8 DP x 2 TP GPUs per stage over an EP 4 x ETP 1 grid: 4 expert-DP ranks
    shards = expert_data_parallel(data_parallel=8, tensor_parallel=2, context_parallel=1, expert_parallel=4,
                                  expert_tensor_parallel=1)
    assert shards == 8 * 2 // 4
    parts = {c.name: c.bytes for c in static_components(counts, grad_bytes=2, rule=rule, expert_shards=shards)}
    assert parts["optimizer states"] == dense * 12 // 8 + experts * 12 // 4
