"""Muon's optimizer state: which parameters it steps itself, its bytes per parameter, the layer-wise optimizer's
division over the data-parallel ranks and its all-gather, from a tiny MoE model's shapes counted by hand."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate import estimate, muon, phases, static
from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config
from tests.support.settings import optimizer_config

pytestmark = [pytest.mark.unit]

SHAPE = TinyGPTShape(layers=2, hidden=64, heads=4, kv_heads=2, seq=32, micro_batch=1, vocab=128, tp=1,
                     sequence_parallel=False, dtype="bfloat16", swiglu=True, experts=4, topk=2, moe_ffn=32,
                     dispatcher="alltoall")
DP = 4


def _by_hand(shape: TinyGPTShape) -> dict[str, int]:
    """The tiny model's trainable parameters (linears without biases, LayerNorm with one, untied output, RoPE):
    Muon's matrices and the rest."""
    h, kv = shape.hidden, shape.hidden // shape.heads
    qkv = (shape.heads + 2 * shape.kv_heads) * kv * h
    proj = shape.heads * kv * h
    router = shape.experts * h
    expert = 2 * shape.moe_ffn * h + shape.moe_ffn * h  # fc1 (gate and up) + fc2
    norm = 2 * h  # LayerNorm's weight and bias: one-dimensional
    return {"dense matrices": shape.layers * (qkv + proj + router),
            "expert matrices": shape.layers * shape.experts * expert,
            "scalar": 2 * shape.vocab * h + shape.layers * 2 * norm + norm}  # embedding, output layer, norms


def _muon_config(name: str = "dist_muon"):
    cfg = tiny_config(SHAPE)
    cfg.optimizer.optimizer = name
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.overlap_param_gather = cfg.optimizer.overlap_param_gather = False
    cfg.ddp.grad_reduce_in_fp32 = True
    return cfg


@pytest.fixture(scope="module")
def layer_wise():
    return estimate(_muon_config(), data_parallel_size=DP, device="cpu")


def test_the_layer_wise_optimizer_deals_muons_matrices_and_adams_rest_over_the_dp_ranks(layer_wise):
    """bf16 parameters: a matrix costs an fp32 main copy + an fp32 momentum, every other parameter Adam's fp32 main
    copy + two fp32 moments; DP = 4 ranks divide the dense ones and, expert DP being DP here, the experts'."""
    n = _by_hand(SHAPE)
    dense = -(-n["dense matrices"] * 8 // DP) + -(-n["scalar"] * 12 // DP)
    experts = -(-n["expert matrices"] * 8 // DP)
    assert layer_wise.component("optimizer states").bytes == dense + experts


def test_plain_muon_keeps_every_state_on_every_rank():
    n = _by_hand(SHAPE)
    est = estimate(_muon_config("muon"), data_parallel_size=DP, device="cpu")
    assert est.component("optimizer states").bytes == (n["dense matrices"] + n["expert matrices"]) * 8 + \
        n["scalar"] * 12


def test_the_step_all_gathers_the_larger_of_the_dense_and_the_expert_parameters(layer_wise):
    """allgather_params: each group's shares, all of the rank's parameters of that group in bf16, one group at a
    time; the tiny model's experts outnumber the rest."""
    n = _by_hand(SHAPE)
    gathered = max(n["dense matrices"] + n["scalar"], n["expert matrices"]) * 2
    step = next(p for p in layer_wise.phases if p.name == phases.FIRST_STEP)
    gather = next(c for c in step.components if c.name == muon.ALL_GATHER)
    assert gather.bytes == gathered


def test_a_single_rank_gathers_nothing():
    assert muon.gather_transient(optimizer_config(optimizer="dist_muon"), 100, 200, param_bytes=2, dense_shards=1,
                                 expert_shards=1) is None
    assert muon.gather_transient(optimizer_config(optimizer="adam", use_layer_wise_distributed_optimizer=True), 100,
                                 200, param_bytes=2, dense_shards=4, expert_shards=4) is None


@pytest.mark.parametrize("fields, setting", [
    ({"muon_scalar_optimizer": "lion"}, "optimizer.muon_scalar_optimizer"),
    ({"use_distributed_optimizer": True}, "ddp.use_distributed_optimizer"),
    ({"optimizer_cpu_offload": True}, "optimizer.optimizer_cpu_offload"),
    ({"overlap_param_gather": True}, "ddp.overlap_param_gather")])
def test_a_muon_set_up_the_estimate_does_not_model_is_refused_by_name(fields, setting):
    config = optimizer_config(**{"optimizer": "dist_muon", "use_distributed_optimizer": False, **fields})
    assert [f.setting for f in static.optimizer_findings(config)] == [setting]


def test_an_emerging_optimizer_other_than_muon_is_refused_by_name():
    assert static.optimizer_findings(optimizer_config(optimizer="muon", use_distributed_optimizer=False)) == []
    assert [f.setting for f in static.optimizer_findings(optimizer_config(optimizer="soap"))] == \
        ["optimizer.optimizer"]
