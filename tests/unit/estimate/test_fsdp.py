"""Megatron-FSDP in the estimate: the sharded buffers and the unsharded buckets of the tiny GPT from its shapes and
Megatron Core's layout rules (each layer padded to DP x its widest row), the prefetch and reduce-scatter windows,
the step over the main-weight shard, and the phases."""

from __future__ import annotations

import math
import types

import pytest
import torch

from megatron_bridge_ext.estimate import fsdp, phases
from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

pytestmark = [pytest.mark.unit]

S = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=64, micro_batch=1, vocab=128, tp=1,
                 sequence_parallel=False, dtype="bfloat16", swiglu=True)
DP, BF16, FP32 = 2, 2, 4


def _layer_elements(s: TinyGPTShape) -> int:
    """A local-spec layer: QKV, projection, gated fc1, fc2, and two LayerNorms with weight and bias."""
    d = s.hidden // s.heads
    return ((s.heads + 2 * s.kv_heads) * d * s.hidden + s.hidden * s.hidden + 2 * s.ffn * s.hidden
            + s.hidden * s.ffn + 2 * 2 * s.hidden)


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _estimate(strategy: str, **ddp):
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    cfg = tiny_config(S)
    cfg.ddp.use_megatron_fsdp, cfg.ddp.data_parallel_sharding_strategy = True, strategy
    for name, value in ddp.items():
        setattr(cfg.ddp, name, value)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    return estimate(cfg, data_parallel_size=DP, attention="local", transformer_impl="local", device="cpu")


def test_optim_grads_params_shards_each_layer_padded_to_dp_times_its_widest_row():
    """Each layer is a unit bucket padded to DP x fc2's row (the FFN width; its other rows divide it, its norms are
    fragments at the tail); the embedding, final norm and output layer share one bucket outside the units, padded to
    DP x h. Backward holds every layer gathered (the prefetch reaches 5 x 10^8 elements) and every layer's gradient
    bucket (the queue holds 10^9), in bf16, plus the bucket outside the units."""
    layer = _padded(_layer_elements(S), DP * S.ffn)
    outside = _padded(2 * S.vocab * S.hidden + 2 * S.hidden, DP * S.hidden)
    shard = S.layers * layer // DP + outside // DP
    lines = {c.name: c.bytes for c in _estimate("optim_grads_params").components}
    assert lines["weights: Megatron-FSDP model weights"] == shard * BF16
    assert lines["gradients (Megatron-FSDP main gradients)"] == shard * BF16
    assert lines[phases.OPTIMIZER_STATES] == shard * FP32 + shard * (FP32 + FP32)
    assert lines[fsdp.NON_UNITS] == outside * BF16
    assert lines[fsdp.UNITS] == S.layers * layer * BF16 + (outside + S.layers * layer) * BF16


def test_optim_grads_holds_the_whole_gradient_bucket_through_backward_and_no_shard_shards_nothing():
    """Without units and without ddp.bucket_size the model is one bucket: under optim_grads its whole gradient is
    allocated at the first gradient and reduce-scattered at the end of backward."""
    whole = _padded(S.layers * _layer_elements(S) + 2 * S.vocab * S.hidden + 2 * S.hidden, DP * S.ffn)
    grads = _estimate("optim_grads")
    assert grads.component("gradients (Megatron-FSDP main gradients)").bytes == whole // DP * BF16
    assert grads.component(fsdp.UNITS).bytes == whole * BF16
    plain = _estimate("no_shard")
    params = S.layers * _layer_elements(S) + 2 * S.vocab * S.hidden + 2 * S.hidden
    assert plain.component("weights: Megatron-FSDP model weights").bytes == params * BF16
    assert plain.component(phases.OPTIMIZER_STATES).bytes == params * (FP32 + 2 * FP32)


def test_the_prefetch_stops_once_the_prefetched_units_reach_half_the_communication_unit():
    """A unit plus the units after it until the prefetched elements reach the limit: ceil(limit / unit) of them."""
    unit, limit = 100, 250
    assert fsdp.gathered_window([unit] * 8, limit) == unit * (1 + math.ceil(limit / unit))
    assert fsdp.gathered_window([unit] * 2, limit) == 2 * unit  # no more units to prefetch


def test_the_reduce_scatter_queue_is_trimmed_to_its_capacity_before_a_bucket_joins():
    """After a trim the queue holds at most floor(capacity / bucket) buckets; then the finished bucket joins it while
    the next one is filled: two more."""
    bucket, capacity = 100, 250
    assert fsdp.reduce_window([bucket] * 8, capacity) == bucket * (capacity // bucket + 2)


def test_a_given_communication_unit_narrows_both_windows():
    est = _estimate("optim_grads_params", suggested_communication_unit_size=_padded(_layer_elements(S), DP * S.ffn))
    layer = _padded(_layer_elements(S), DP * S.ffn)
    outside = _padded(2 * S.vocab * S.hidden + 2 * S.hidden, DP * S.hidden)
    gathered = 2 * layer  # the prefetch of half a layer takes one more layer
    queued = (layer // layer + 2) * layer
    assert est.component(fsdp.UNITS).bytes == gathered * BF16 + (outside + queued) * BF16


def _layout(elements=1000):
    return fsdp.Layout("optim_grads_params", 0, elements * FP32, 0, elements, 0, 0, "")


def test_without_the_decoupled_gradient_the_step_casts_the_bf16_gradient_shard_to_fp32_and_keeps_it():
    ddp = types.SimpleNamespace(megatron_fsdp_main_params_dtype=torch.float32)
    step = fsdp.step_state(types.SimpleNamespace(use_precision_aware_optimizer=False), ddp, _layout(), param_bytes=2)
    assert [(c.name, c.bytes) for c in step.transients] == [(phases.FP32_GRAD_COPIES, 1000 * FP32)]
    assert step.kept == (phases.FP32_GRAD_COPIES,) and (step.masters, step.moments) == (1000 * FP32, 1000 * 8)


def test_the_precision_aware_optimizer_keeps_bf16_moments_and_unscales_them_without_a_master_copy():
    """Core turns FusedAdam's master weights off over Megatron-FSDP (optimizer/__init__.py L1116-1128) and Bridge
    turns the decoupled gradient on (training/config.py L1079-1084): no cast copy. Two bf16 moments are unscaled in
    TE's kernel (no copy); fp16 moments are copied to fp32 in the step."""
    from megatron_bridge_ext.levers import fsdp as rules

    optimizer = types.SimpleNamespace(use_precision_aware_optimizer=True, use_distributed_optimizer=True,
                                      exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    ddp = types.SimpleNamespace(megatron_fsdp_main_params_dtype=torch.float32, use_distributed_optimizer=True)
    rules.bridge_applies(optimizer, ddp)
    step = fsdp.step_state(optimizer, ddp, _layout(), param_bytes=2)
    assert (step.masters, step.moments) == (1000 * FP32, 1000 * (BF16 + BF16))
    assert step.transients == ()
    optimizer.exp_avg_dtype = optimizer.exp_avg_sq_dtype = torch.float16
    step = fsdp.step_state(optimizer, ddp, _layout(), param_bytes=2)
    assert [(c.name, c.bytes) for c in step.transients] == [(phases.UNSCALED_STATES, 1000 * FP32 * 2)]


def test_the_buckets_in_flight_are_gone_in_the_optimizer_step():
    est = _estimate("optim_grads_params")
    in_flight = est.component(fsdp.UNITS)
    step = next(p for p in phases.phases(est) if p.name == phases.FIRST_STEP)
    assert all(c.name != fsdp.UNITS for c in step.components)
    steady = next(p for p in phases.phases(est) if p.name == phases.STEADY)
    assert in_flight in steady.components
