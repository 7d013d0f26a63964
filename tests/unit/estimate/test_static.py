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


@pytest.mark.parametrize("fp32, param_bytes, expected", [(True, 2, 4), (False, 2, 2), (False, 4, 4), (True, 4, 4)])
def test_the_gradient_buffer_takes_fp32_with_grad_reduce_in_fp32_and_the_parameter_dtype_otherwise(
        fp32, param_bytes, expected):
    from types import SimpleNamespace

    from megatron_bridge_ext.estimate.static import grad_buffer_bytes

    assert grad_buffer_bytes(SimpleNamespace(grad_reduce_in_fp32=fp32), param_bytes) == expected


@pytest.mark.parametrize("fp32", [False, True])
def test_the_estimates_gradient_line_is_the_trainable_parameters_at_the_buffers_dtype(fp32):
    """A bf16 LoRA model: the adapters alone have gradients, 2 B each in a bf16 buffer, 4 B with
    grad_reduce_in_fp32; their count comes from the shape (LoRA on qkv, proj, fc1, fc2, split over TP)."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.peft import LoRA
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config
    from tests.support.estimate import adapter_params

    shape = TinyGPTShape(layers=2, hidden=64, ffn=256, heads=8, kv_heads=4, seq=64, micro_batch=1, vocab=128, tp=2,
                         dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, LoRA(target_modules=list(shape.lora_targets), dim=shape.lora_rank, alpha=16))
    cfg.ddp.grad_reduce_in_fp32 = fp32
    hf = dict(hidden_size=shape.hidden, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
              intermediate_size=shape.ffn, model_type="gpt")
    trainable = shape.layers * adapter_params(hf, shape.tp, shape.lora_rank)
    assert estimate(cfg).component("gradients (main_grad buffer)").bytes == trainable * (4 if fp32 else 2)


SIZES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
"""Bytes per element of each state dtype FusedAdam accepts for the moments (fp8 is its ``torch.uint8`` state)."""
TORCH = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "uint8"}


@pytest.mark.parametrize("exp_avg", list(SIZES))
@pytest.mark.parametrize("exp_avg_sq", list(SIZES))
@pytest.mark.parametrize("main", ["fp32", "fp16"])
def test_every_precision_aware_dtype_combination_fused_adam_accepts_is_counted(exp_avg, exp_avg_sq, main):
    """bf16 parameters without remainders: FusedAdam's master in main_params_dtype plus each moment in its dtype;
    the step copies to fp32 each fp16 or FP8 state, and each bf16 moment unless both moments are bf16 (TE v2.14+
    unscales those inside its kernel: fused_adam.py fuse_unscale, get_unscaled_state's skip_unscale)."""
    import torch

    from megatron_bridge_ext.estimate import phases, static
    from tests.support.settings import optimizer_config

    config = optimizer_config(use_precision_aware_optimizer=True, main_params_dtype=getattr(torch, TORCH[main]),
                              exp_avg_dtype=getattr(torch, TORCH[exp_avg]),
                              exp_avg_sq_dtype=getattr(torch, TORCH[exp_avg_sq]))
    assert static.optimizer_findings(config) == []
    rule = optimizer_rule(config, param_bytes=2, data_parallel=1, context_parallel=1)
    assert rule.bytes_per_parameter == SIZES[main] + SIZES[exp_avg] + SIZES[exp_avg_sq]
    counts = _counts(1000, frozen_layers=0)
    step = phases.step_state(config, static.optimizer_shard(counts, rule), rule, grad_bytes=4)
    fused = exp_avg == exp_avg_sq == "bf16"
    low = sum(d in ("fp16", "fp8") or (d == "bf16" and not fused) for d in (exp_avg, exp_avg_sq, main))
    assert sum(c.bytes for c in step.transients) == 1000 * 4 * low


def test_bf16_master_weights_are_refused_as_fused_adam_refuses_them():
    import torch

    from megatron_bridge_ext.estimate import static
    from tests.support.settings import optimizer_config

    config = optimizer_config(use_precision_aware_optimizer=True, main_params_dtype=torch.bfloat16)
    assert [f.setting for f in static.optimizer_findings(config)] == ["optimizer.main_params_dtype"]
