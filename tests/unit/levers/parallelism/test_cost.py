"""The expert-parallel traffic formulas (``megatron_bridge_ext/levers/parallelism/cost.py``), checked against
routings and collectives simulated token by token, not against the formulas' own algebra."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatron_bridge_ext.levers.parallelism import cost
from tests.support.settings import experts, gpt_stage, lora

pytestmark = [pytest.mark.unit]

S = gpt_stage(seq_length=1024, micro_batch=2, hidden=64, tp=2, cp=1, dp=4, pp=1, sequence_parallel=True,
              gated_linear_unit=True, layers_on_stage=4, stage=0, num_layers=4, num_microbatches=3, peft=None)


def _model(**fields):
    base = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, ffn_hidden_size=256,
                tensor_model_parallel_size=2, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                moe_layer_freq=1, num_layers=4, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                moe_shared_expert_intermediate_size=None)
    return SimpleNamespace(**{**base, **fields})


def _moe(**fields):
    return cost.moe_shape(_model(**fields))


def test_moe_shape_fills_in_cores_defaults():
    assert cost.moe_shape(_model(num_moe_experts=None)) is None
    shape = _moe(moe_ffn_hidden_size=None, moe_layer_freq=2)
    assert shape["moe_ffn"] == 256  # Core: moe_ffn_hidden_size defaults to ffn_hidden_size
    assert shape["pattern"] == [1, 0, 1, 0]  # every 2nd layer from the first
    assert shape["etp"] == 2  # unset with EP = 1: TP (Core)
    assert _moe(expert_model_parallel_size=2)["etp"] == 1  # unset with EP > 1: 1 (Bridge's finalize)
    assert _moe(moe_layer_freq=[0, 1, 1, 0])["pattern"] == [0, 1, 1, 0]


def test_layer_kinds_of_the_first_and_the_last_stage():
    moe = _moe(moe_layer_freq=[0, 0, 1, 1, 1, 0], num_layers=6)
    assert cost.stage_layer_kinds(replace(S, layers_on_stage=3, stage=0), moe) == (2, 1)  # layers 0-2
    assert cost.stage_layer_kinds(replace(S, layers_on_stage=3, stage=1), moe) == (1, 2)  # layers 3-5
    assert cost.stage_layer_kinds(S, None) == (4, 0)
    assert cost.stage_layer_kinds(replace(S, moe=experts(1)), _moe()) == (3, 1)  # the estimate's own count wins


def _balanced_routing(ranks: int, tokens: int, topk: int, experts: int) -> list[list[list[int]]]:
    """routing[rank][token] = the token's experts: consecutive experts from a rotating start, every expert chosen
    equally often (the balanced load the formulas assume)."""
    return [[[(rank * tokens * topk + token * topk + j) % experts for j in range(topk)] for token in range(tokens)]
            for rank in range(ranks)]


@pytest.mark.parametrize("ep, etp", [(2, 1), (4, 1), (8, 1), (2, 2), (1, 2)])
def test_alltoall_dispatch_counts_the_token_copies_that_leave_the_rank(ep, etp):
    moe = _moe(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    element, h = 2, S.hidden
    tokens = S.seq_length // S.tp * S.micro_batch  # the rank's sequence shard under SP
    routing = _balanced_routing(ep, tokens, moe["topk"], moe["experts"])
    owner = {e: e // (moe["experts"] // ep) for e in range(moe["experts"])}  # contiguous experts per EP rank
    rank = 0
    sent = sum(owner[e] != rank for token in routing[rank] for e in token)  # token copies to other EP ranks
    received = sum(owner[e] == rank for r in range(ep) for token in routing[r] for e in token)  # tokens for rank 0
    a2a = sent * h * element  # dispatch forward; combine forward returns as many, backward repeats both
    gather = received * h * element * (etp - 1)  # expert-TP all-gather of the received tokens (and its reduce-scatter)
    assert cost.dispatch_bytes_per_layer(S, moe, ep=ep, etp=etp, element=element) == 4 * a2a + 4 * gather
    assert cost.dispatch_bytes_per_layer(S, moe, ep=ep, etp=etp, element=element, passes=2) == 2 * a2a + 2 * gather


@pytest.mark.parametrize("ep, etp", [(1, 1), (2, 1), (4, 2)])
def test_allgather_dispatch_sends_the_rank_tokens_to_every_other_rank_of_the_group(ep, etp):
    moe = _moe(moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    tokens = S.seq_length // S.tp * S.micro_batch
    chunk = tokens * S.hidden * 2  # the rank's [T, h] in bf16
    others = ep * etp - 1
    # forward all-gather + reduce-scatter of the combine, and their duals in backward
    assert cost.dispatch_bytes_per_layer(S, moe, ep=ep, etp=etp, element=2) == 4 * chunk * others


def test_tp_traffic_of_moe_layers_is_attentions_half_and_the_shared_experts():
    one = cost.tp_collective_bytes(S, tp=2, layers=1, num_microbatches=1, element=2)  # a dense layer
    sbh_share = S.seq_length * S.micro_batch * S.hidden * 2 // 2  # (t-1)/t of [s, b, h] in bf16
    assert one == 8 * sbh_share  # 2 all-gathers + 2 reduce-scatters, forward and backward
    assert cost.tp_collective_bytes(S, tp=2, layers=3, num_microbatches=1, element=2, moe_layers=2) \
        == one + 2 * 4 * sbh_share
    assert cost.tp_collective_bytes(S, tp=2, layers=3, num_microbatches=1, element=2, moe_layers=2,
                                    shared_experts=True) == 3 * one


def test_expert_parameters_and_their_data_parallel_traffic():
    moe = _moe(num_moe_experts=8, moe_ffn_hidden_size=32)
    # fc1 64 -> 2 x 32 (SwiGLU), fc2 32 -> 64: 6144 per expert; EP 2 keeps 4 experts; ETP 2 halves each
    assert cost.expert_parameters_per_rank(S, moe, ep=2, etp=2, moe_layers=3) == 3 * 4 * (64 * 64 + 32 * 64) // 2
    assert cost.expert_dp_size(S, ep=2, etp=2) == 2  # TP 2 x DP 4 GPUs over a 2 x 2 expert grid
    params = cost.expert_parameters_per_rank(S, moe, ep=2, etp=1, moe_layers=4)
    edp = cost.expert_dp_size(S, ep=2, etp=1)
    assert edp == 4
    # reduce-scatter of the gradients and all-gather of the parameters, each 3 of 4 shares from this rank
    assert cost.expert_dp_bytes(S, moe, ep=2, etp=1, moe_layers=4, element=2) == 2 * (params * 2 * 3 // 4)
    assert cost.expert_dp_bytes(replace(S, peft=lora()), moe, ep=2, etp=1, moe_layers=4, element=2) == 0  # frozen experts
    assert cost.expert_dp_bytes(S, moe, ep=8, etp=1, moe_layers=4, element=2) == 0  # expert DP of 1: nothing to sync


def test_doubling_ep_changes_dispatch_and_halves_the_expert_weights_traffic():
    """EP 2 -> 4 on TP 2 x DP 4: the dispatch grows by the token copies now leaving the rank, and the expert-DP
    traffic goes from 2P(EDP-1)/EDP to 2(P/2)(EDP/2-1)/(EDP/2): P*e less (P the rank's expert parameters at EP 2)."""
    moe, element = _moe(expert_model_parallel_size=2, expert_tensor_parallel_size=1), 2
    after = {**moe, "ep": 4}
    change, basis = cost.traffic_change(S, S, element, moe, after)
    layers, nmb = S.layers_on_stage, S.num_microbatches
    dispatch = (cost.dispatch_bytes_per_layer(S, moe, ep=4, etp=1, element=element)
                - cost.dispatch_bytes_per_layer(S, moe, ep=2, etp=1, element=element)) * layers * nmb
    params = cost.expert_parameters_per_rank(S, moe, ep=2, etp=1, moe_layers=layers)
    assert change == dispatch - params * element
    assert "4*T*k*h*e*(EP-1)/EP" in basis and "EDP" in basis
    dense_change, dense_basis = cost.traffic_change(S, S, element)
    assert dense_change == 0 and "EDP" not in dense_basis
