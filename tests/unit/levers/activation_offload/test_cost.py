"""The host-link bytes of fine-grained activation offloading, from the shapes, and their step time."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.levers import steptime
from megatron_bridge_ext.levers.activation_offload import cost
from tests.support.settings import gpt_stage

pytestmark = [pytest.mark.unit]


def test_a_step_sends_each_microbatch_to_the_host_and_back():
    assert cost.step_bytes(1000, 4) == 2 * 1000 * 4


def test_the_predicted_host_bytes_are_the_attention_inputs_per_tp_rank():
    """TP 2 with SP, s 1024, b 1, h 1024, 8 heads and 8 groups of 128, 2 layers, bf16: linear_qkv's input shard
    [s/2, b, h], q, k, v [s, b, 4 x 128] and the output [s, b, 512] twice (core_attn and attn_proj)."""
    s = gpt_stage()
    qkv_input = 1024 // 2 * 1024
    local = 1024 * 8 * 128 // 2
    per_layer = qkv_input + 3 * local + 2 * local
    assert cost.predicted_host_bytes(s, cost.ATTENTION) == per_layer * 2 * 2
    assert cost.predicted_host_bytes(s, ("core_attn",)) == 4 * local * 2 * 2


def test_the_copies_cost_what_exceeds_the_compute_and_at_least_one_layers_share():
    s = gpt_stage()
    gpu = steptime.gpu("h100")
    compute = steptime.step_time(s, gpu).compute
    small = steptime.step_time(s, gpu, offload_bytes=cost.step_bytes(1 << 20, s.num_microbatches))
    assert small.offload_exposed == pytest.approx(2 * (1 << 20) * s.num_microbatches / gpu.pcie / s.layers_on_stage)
    big_bytes = int(4 * compute * gpu.pcie)
    big = steptime.step_time(s, gpu, offload_bytes=big_bytes)
    assert big.offload_exposed == pytest.approx(big_bytes / gpu.pcie - compute)


def test_the_predicted_host_bytes_of_the_experts_groups_are_fc1s_input_and_the_activations_per_moe_layer():
    """TP 2 with SP, s 1024, b 1, h 1024, 2 MoE layers of 8 experts, top-2, expert FFN 512, ETP 1, bf16: each rank's
    512 tokens x 2 reach the experts; fc1's input [1024, h] and the fused activation's input [1024, 2 x 512]."""
    from tests.support.settings import experts

    s = gpt_stage(moe=experts(2))
    routed = 1024 // 2 * 2
    assert cost.predicted_host_bytes(s, ("expert_fc1",)) == routed * 1024 * 2 * 2
    assert cost.predicted_host_bytes(s, cost.EXPERTS) == routed * (1024 + 2 * 512) * 2 * 2
    assert cost.predicted_host_bytes(gpt_stage(), cost.EXPERTS) == 0
