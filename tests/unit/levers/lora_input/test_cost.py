"""What a LoRA-A input strategy costs in the plan: the collective elements its adapters move, derived from the shapes."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.levers.lora_input import cost as lora_input_cost
from megatron_bridge_ext.estimate.settings import HybridSettings
from tests.support.settings import experts, gpt_stage, lora

pytestmark = [pytest.mark.unit]


def test_lora_input_collective_elements_per_adapter():
    s, b, h, r = 1024, 2, 64, 8
    # Bridge's path gathers x and reduce-scatters its gradient; shard_local gathers A twice and
    # reduce-scatters A's gradient; all three gather the [s, b, r] LoRA-A output.
    assert lora_input_cost.lora_input_collective_elements("off", seq=s, micro_batch=b, hidden=h, rank=r) \
        == s * b * r + 2 * s * b * h
    assert lora_input_cost.lora_input_collective_elements("regather", seq=s, micro_batch=b, hidden=h, rank=r) \
        == s * b * r + 3 * s * b * h
    assert lora_input_cost.lora_input_collective_elements("shard_local", seq=s, micro_batch=b, hidden=h, rank=r) \
        == s * b * r + 3 * r * h
    assert lora_input_cost.lora_input_collective_elements("off", seq=s, micro_batch=b, hidden=h, rank=r,
                                                          input_needs_grad=False) == s * b * r + s * b * h


def test_lora_input_collectives_count_every_adapter_of_canonical_lora():
    from megatron_bridge_ext.estimate.report import MemoryEstimate

    targets = ["linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_up", "linear_fc1_gate", "linear_fc2"]
    settings = gpt_stage(seq_length=1024, micro_batch=2, hidden=64, layers_on_stage=3, num_microbatches=2,
                         dtype="bfloat16", peft=lora(8, targets, strategy="off", kind="canonical_lora"))
    est = MemoryEstimate(stage=0, components=[], settings=settings, assumptions=[], activations_per_microbatch={},
                         in_flight_microbatches=1)
    change, _ = lora_input_cost.collective_change(est, "shard_local")
    s, b, h, r = 1024, 2, 64, 8
    # Five LoRA-A on column-parallel layers per layer; each trades Bridge's s*b*h gather and gradient
    # reduce-scatter for r*h-sized ones, except layer 0's three q/k/v adapters, whose input (the frozen
    # embedding's output) needs no gradient.
    with_grad = (s * b * r + 3 * r * h) - (s * b * r + 2 * s * b * h)
    without_grad = (s * b * r + 2 * r * h) - (s * b * r + s * b * h)
    adapters_with_grad = 3 * 5 - 3
    assert change == (adapters_with_grad * with_grad + 3 * without_grad) * 2 * 2  # x microbatches x bf16


def test_each_strategys_description_names_the_collectives_its_price_counts():
    """The strategy registry's words and the plan's count agree: a size the description names once is counted once
    (seq x micro-batch 1000, hidden 10**6 and rank 1 keep s*b*h, r*h and s*b*r apart in the total)."""
    from megatron_bridge_ext.levers.lora_input import sp_lora

    for name, strategy in sp_lora.STRATEGIES.items():
        total = lora_input_cost.lora_input_collective_elements(name, seq=1000, micro_batch=1, hidden=10**6, rank=1)
        sbh, rest = divmod(total, 10**9)
        rh, sbr = divmod(rest, 10**6)
        named = {size: strategy.communicates.count(f"({size}") for size in ("s*b*h", "r*h", "s*b*r")}
        assert named == {"s*b*h": sbh, "r*h": rh, "s*b*r": sbr // 1000}, (name, strategy.communicates)


def test_a_hybrid_stage_counts_linear_qkv_on_attention_layers_and_linear_fc1_on_mlp_and_moe_layers():
    """Pattern M*E-M (2 Mamba, 1 attention, 1 MoE, 1 MLP): Bridge's path on linear_qkv and linear_fc1 gathers x
    (s*b*h) and the rank-r output (s*b*r) and reduce-scatters x's gradient: one linear_qkv (its input has a gradient:
    the Mamba layer before it trains), two linear_fc1 (the MLP layer's and the MoE layer's shared expert); the
    Mamba layers' in_proj is no eligible surface."""
    seq, b, h, r = 64, 1, 32, 4
    s = gpt_stage(seq_length=seq, micro_batch=b, hidden=h, layers_on_stage=5,
                  peft=lora(r, ["linear_qkv", "linear_fc1", "in_proj"]),
                  hybrid=HybridSettings({"Mamba": 2, "attention": 1, "MoE": 1, "MLP": 1}, None),
                  moe=experts(1, shared_ffn=48))
    per_adapter = seq * b * h + seq * b * r + seq * b * h
    assert lora_input_cost.collective_elements(s, "off", stage=0) == 3 * per_adapter


@pytest.mark.parametrize("moe_layers, shared_ffn, qkv, fc1", [
    (0, 0, 4, 4),  # dense: both surfaces on every layer
    (4, 0, 4, 0),  # every layer MoE without shared experts (Qwen3-30B-A3B): a routed expert's fc1 is no surface
    (4, 64, 4, 4),  # shared experts: their linear_fc1 is one, on every MoE layer
    (3, 0, 4, 1),  # one dense layer among MoE layers (moe_layer_freq)
])
def test_linear_fc1_counts_on_dense_layers_and_on_moe_layers_only_through_shared_experts(moe_layers, shared_ffn,
                                                                                          qkv, fc1):
    """Layer 0's linear_qkv takes the frozen embedding's output on stage 1 as any other layer's input (stage 1: no
    exemption), so each adapter moves Bridge's s*b*h gather, s*b*r and the s*b*h gradient reduce-scatter."""
    seq, b, h, r = 64, 1, 32, 4
    s = gpt_stage(seq_length=seq, micro_batch=b, hidden=h, layers_on_stage=4,
                  peft=lora(r, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
                  moe=experts(moe_layers, shared_ffn=shared_ffn) if moe_layers else None)
    per_adapter = seq * b * h + seq * b * r + seq * b * h
    assert lora_input_cost.collective_elements(s, "off", stage=1) == (qkv + fc1) * per_adapter
    assert lora_input_cost.eligible_adapters(s) == qkv + fc1
