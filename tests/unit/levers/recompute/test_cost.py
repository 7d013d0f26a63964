"""What recompute costs in the plan (the forward FLOPs it repeats), and resizing TP (the activation traffic), derived from the shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_bridge_ext.levers.parallelism import cost as parallelism_cost
from megatron_bridge_ext.estimate.settings import Settings
from megatron_bridge_ext.levers.recompute import cost as recompute_cost
from tests.support.settings import gpt_stage, latent

pytestmark = [pytest.mark.unit]


def test_recompute_flops_and_tp_traffic_formulas():
    s = gpt_stage(seq_length=1024, micro_batch=2, hidden=64, tp=2, heads=8, kv_channels=8, ffn=256,
                  gated_linear_unit=True, sequence_parallel=True)
    # Attention: Q K^T and probabilities x V, 2 FLOPs per multiply-add, 4 heads per rank.
    assert recompute_cost.recompute_flops_per_layer("core_attn", s) == 2 * (2 * 2 * 1024 * 1024 * 4 * 8)
    # MLP: fc1 (2 x 128 outputs per rank with SwiGLU) and fc2 (128 inputs per rank).
    assert recompute_cost.recompute_flops_per_layer("mlp", s) == 2 * 2 * 1024 * 64 * 256 + 2 * 2 * 1024 * 128 * 64
    assert parallelism_cost.tp_collective_bytes(s, tp=1, layers=4, num_microbatches=2, element=2) == 0
    assert parallelism_cost.tp_collective_bytes(s, tp=2, layers=4, num_microbatches=2, element=2) \
        == 8 * 1024 * 2 * 64 * 2 // 2 * 4 * 2


# ------------------------------------------------------------------------------------------------
# Mixture of experts: the FLOPs of the MoE modules, against torch's FLOP counter on a layer written out with
# the rank's shapes (meta tensors: nothing is allocated).

MOE_S = gpt_stage(seq_length=256, micro_batch=2, hidden=64, tp=2, cp=1, heads=8, kv_channels=8, ffn=256,
                  gated_linear_unit=True, sequence_parallel=True, layers_on_stage=4, stage=0, num_layers=4,
                  num_microbatches=3)


def _moe(*, experts=8, topk=2, moe_ffn=32, shared_ffn=0, ep=2, etp=2, pattern=(1, 0, 1, 1)):
    return {"experts": experts, "topk": topk, "moe_ffn": moe_ffn, "shared_ffn": shared_ffn, "ep": ep, "etp": etp,
            "dispatcher": "alltoall", "grouped_gemm": True, "pattern": list(pattern)}


def _counted(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _mlp(tokens: int, h: int, width: int):
    """A SwiGLU MLP's GEMMs on ``tokens`` tokens: fc1 to 2 x width, fc2 back to h."""
    import torch

    x = torch.empty(tokens, h, device="meta")
    up = x @ torch.empty(h, 2 * width, device="meta")
    return up[:, :width] @ torch.empty(width, h, device="meta")


def _moe_layer_on_rank(s: Settings, moe: dict) -> None:
    """One MoE layer's forward as rank 0 runs it under balanced routing: the router on the rank's sequence shard,
    its E/EP experts on the token copies routed to them and gathered over ETP (a 1/ETP shard of each expert's
    width), the shared experts on the gathered sequence (a 1/TP shard)."""
    import torch

    tokens = s.seq_length // s.tp * s.micro_batch
    h = s.hidden
    torch.empty(tokens, h, device="meta") @ torch.empty(h, moe["experts"], device="meta")  # router
    local = moe["experts"] // moe["ep"]
    copies_per_expert = tokens * moe["topk"] * moe["ep"] // moe["experts"]  # every EP rank sends T*k copies
    for _ in range(local):
        _mlp(copies_per_expert * moe["etp"], h, moe["moe_ffn"] // moe["etp"])
    if moe["shared_ffn"]:
        _mlp(s.seq_length * s.micro_batch, h, moe["shared_ffn"] // s.tp)


@pytest.mark.parametrize("shared_ffn", [0, 128])
@pytest.mark.parametrize("ep, etp", [(1, 1), (2, 2), (4, 1)])
def test_moe_recompute_flops_match_the_counted_layer(ep, etp, shared_ffn):
    moe = _moe(ep=ep, etp=etp, shared_ffn=shared_ffn)
    layer = _counted(lambda: _moe_layer_on_rank(MOE_S, moe))
    assert recompute_cost.recompute_flops_per_layer("moe", MOE_S, moe) == layer
    moe_layers = sum(moe["pattern"])  # three of the four layers on the stage
    assert recompute_cost.recompute_flops(MOE_S, ["moe"], moe) == layer * moe_layers * MOE_S.num_microbatches


def test_shared_experts_and_mlp_count_their_own_layers_only():
    moe = _moe(shared_ffn=128)
    shared = _counted(lambda: _mlp(MOE_S.seq_length * MOE_S.micro_batch, 64, 128 // 2))
    assert recompute_cost.recompute_flops(MOE_S, ["shared_experts"], moe) == shared * 3 * 3  # 3 MoE layers, 3 mbs
    dense = _counted(lambda: _mlp(MOE_S.seq_length * MOE_S.micro_batch, 64, 256 // 2))
    assert recompute_cost.recompute_flops(MOE_S, ["mlp"], moe) == dense * 1 * 3  # Core skips mlp on MoE layers
    assert recompute_cost.recompute_flops(MOE_S, ["mlp"]) == dense * 4 * 3  # a dense model: every layer
    assert recompute_cost.recompute_flops(MOE_S, ["moe_act"], moe) == 0  # the activation alone: no GEMM


def test_moe_recompute_repeats_the_forward_dispatch():
    from megatron_bridge_ext.levers.parallelism import cost as parallelism_cost

    moe = _moe(ep=4, etp=1)
    both_ways = parallelism_cost.dispatch_bytes_per_layer(MOE_S, moe, ep=4, etp=1, element=2)  # forward + backward
    assert recompute_cost.recompute_dispatch_bytes(MOE_S, ["moe"], moe, 2) == both_ways // 2 * 3 * 3
    assert recompute_cost.recompute_dispatch_bytes(MOE_S, ["moe_act", "shared_experts"], moe, 2) == 0


# ------------------------------------------------------------------------------------------------
# Multi-latent attention: its up projections and its core, against torch's FLOP counter on the rank's GEMMs.

MLA_S = gpt_stage(seq_length=256, micro_batch=2, hidden=64, tp=2, heads=8, sequence_parallel=True, layers_on_stage=3,
                  num_microbatches=2)


def _up_projections(s: Settings, query_in: int) -> None:
    """The rank's query and key-value up projections (4 of 8 heads) on the gathered sequence."""
    import torch

    m, tokens, heads = s.mla, s.seq_length * s.micro_batch, s.heads // s.tp
    torch.empty(tokens, query_in, device="meta") @ torch.empty(query_in, heads * m.q_head_dim, device="meta")
    torch.empty(tokens, m.kv_lora_rank, device="meta") @ torch.empty(m.kv_lora_rank, heads * (m.qk_head_dim
                                                                                             + m.v_head_dim),
                                                                     device="meta")


def _latent_core(s: Settings) -> None:
    """Q K^T over qk_head_dim + qk_pos_emb_head_dim and probabilities x V over v_head_dim, per rank's heads."""
    import torch

    m, b, seq, heads = s.mla, s.micro_batch, s.seq_length, s.heads // s.tp
    q = torch.empty(b * heads, seq, m.q_head_dim, device="meta")
    scores = q @ torch.empty(b * heads, m.q_head_dim, seq, device="meta")
    scores @ torch.empty(b * heads, seq, m.v_head_dim, device="meta")


@pytest.mark.parametrize("q_lora_rank", [None, 48])
def test_mla_up_proj_recomputes_the_up_projections_on_every_attention_layer(q_lora_rank):
    s = replace(MLA_S, mla=latent(q_lora_rank, 32, 16, 8, 12))  # keys 24 wide, values 12
    layer = _counted(lambda: _up_projections(s, s.hidden if q_lora_rank is None else q_lora_rank))
    assert recompute_cost.recompute_flops_per_layer("mla_up_proj", s) == layer
    assert recompute_cost.recompute_flops(s, ["mla_up_proj"]) == layer * 3 * 2  # 3 layers, 2 microbatches
    assert recompute_cost.recompute_flops_per_layer("core_attn", s) == _counted(lambda: _latent_core(s))
    assert recompute_cost.recompute_flops_per_layer("mla_up_proj", MLA_S) == 0  # no multi-latent attention
