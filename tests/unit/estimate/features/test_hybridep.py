"""The flex dispatcher on HybridEP: stand-ins for HybridEP's dispatch and combine, and its buffers.

What the stand-ins save is checked against the handle ``metadata_preprocess_core`` allocates (DeepEP branch
``hybrid-ep`` 94a9f8f, ``csrc/hybrid_ep/executor/executor.cu`` L89-133); Core's ``_HybridEPManager`` run on CPU
tensors around the stand-ins keeps nothing besides; the buffers against ``intranode.cu`` / ``allgather.cu``; a tiny
MoE model traced on HybridEP against the same model with Core's all-to-all dispatcher, plus what the two paths keep
differently, derived from shapes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate.features import dispatcher, hybridep
from megatron_bridge_ext.estimate.routing import RoutedLoad
from megatron_bridge_ext.measure.saved import SavedActivationMeter

pytestmark = [pytest.mark.unit]

I32, I64, BOOL, FP32, BF16 = 4, 8, 1, 4, 2


def _saved_bytes(run) -> int:
    with SavedActivationMeter() as meter:
        run()
    return meter.result().total_bytes


def _dispatch_saves(layout: hybridep.Layout, non_blocking: bool) -> int:
    x = torch.zeros(layout.tokens, 16, requires_grad=True)
    probs = torch.zeros(layout.tokens, layout.ranks * layout.local_experts, requires_grad=True)
    return _saved_bytes(lambda: hybridep._DispatchSaves.apply(x, probs, layout, 10, non_blocking))


def test_one_nvlink_domain_dispatch_saves_the_handle():
    """Four ranks, 3 local experts, 100 tokens; Core passes no permuted count, so the dispatched-token count is pinned
    host memory. sparse_to_dense_map [100, 4] int32, rdma_to_attn_map [112, 1] bool (rows rounded up to 16),
    attn_to_rdma_map [100, 0], local_expert_routing_map [400, 3] bool, dense_chunk_layout [2 chunks of 64 x 4]
    int32, dense_to_expert_map [400, 3] int32, tokens_per_expert [3] int32, overflow_flag [1] int32."""
    t, g, e = 100, 4, 3
    expected = t * g * I32 + 112 * BOOL + t * g * e * BOOL + 2 * g * I32 + t * g * e * I32 + e * I32 + I32
    assert _dispatch_saves(hybridep.Layout(t, g, e), non_blocking=False) == expected


def test_two_nvlink_domains_dispatch_saves_the_handle():
    """Sixteen ranks in two domains of 8, 2 local experts, 64 tokens, a permuted count given (the dispatched-token
    count on the device): sparse_to_dense_map [128, 8] int32, rdma_to_attn_map [64, 2] bool, attn_to_rdma_map
    [64, 1] bool, the two [1024, 2] maps, dense_chunk_layout [16] int32, tokens_per_expert [2], overflow and count."""
    t, g, e = 64, 16, 2
    expected = (2 * t * 8 * I32 + t * 2 * BOOL + t * BOOL + t * g * e * (BOOL + I32) + g * I32 + e * I32
                + I32 + I32)
    assert _dispatch_saves(hybridep.Layout(t, g, e), non_blocking=True) == expected


def _manager(tokens_per_rank: int, ranks: int, local: int, topk: int, budget=None):
    """Core's ``_HybridEPManager`` built with the stand-ins in place (its constructor's device flag on a fake
    tensor: nothing here has CUDA), with the config fields its dispatch and combine read; ``budget``: the rank
    capacity factor, with the TE op fuser it needs (transformer_config.py L1698-1706)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager

    config = SimpleNamespace(moe_permute_fusion=False, moe_expert_capacity_factor=None,
                             moe_pad_expert_input_to_capacity=False, moe_expert_rank_capacity_factor=budget,
                             use_transformer_engine_op_fuser=budget is not None,
                             moe_hybridep_pad_uneven_dispatch_inputs=False, moe_router_topk=topk, fp8=None, fp4=None,
                             moe_flex_dispatcher_num_sms=None, moe_hybridep_num_blocks_permute=None,
                             moe_hybridep_num_blocks_unpermute=None, moe_permute_fusion_into_hybridep=False,
                             moe_hybridep_num_sms_preprocessing=108)
    group = SimpleNamespace(size=lambda: ranks)
    with FakeTensorMode(allow_non_fake_inputs=True):
        return _HybridEPManager(group, local, ranks * local, config)


def test_cores_manager_keeps_nothing_besides_the_handle():
    """Core's ``setup_metadata``, ``dispatch`` (with its fp32 cast of bf16 probabilities), the experts' view and
    ``combine`` on CPU tensors, 96 tokens top-2 of 8 experts over 4 ranks: the meter sees the handle and nothing
    else; the experts get one row per (token, local expert) pair, 4 x ceil(96 x 2 / 8) x 2 = 192, with fp32
    probabilities, and the combine gives back the 96 tokens."""
    t, g, local, topk, h = 96, 4, 2, 2, 16
    model = SimpleNamespace(moe_router_topk=topk, num_moe_experts=g * local)
    with hybridep.hybridep_kernels(RoutedLoad(), model):
        manager = _manager(t, g, local, topk)
        x = torch.zeros(t, h, dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(t, g * local, dtype=torch.bfloat16, requires_grad=True)
        out = {}

        def run():
            manager.setup_metadata(torch.zeros(t, g * local, dtype=torch.bool), probs)
            hidden = manager.dispatch(x)
            out["hidden"], out["probs"] = manager.get_permuted_hidden_states_by_experts(hidden)
            out["combined"] = manager.combine(manager.get_restored_hidden_states_by_experts(out["hidden"]))

        saved = _saved_bytes(run)
    assert saved == hybridep.handle_bytes(hybridep.Layout(t, g, local), non_blocking=False)
    pairs = g * math.ceil(t * topk / (g * local)) * local
    assert tuple(out["hidden"].shape) == (pairs, h) and tuple(out["probs"].shape) == (pairs,)
    assert out["probs"].dtype == torch.float32 and tuple(out["combined"].shape) == (t, h)


def test_buffers_of_one_nvlink_domain():
    """EP 8, 6 local experts, h 2048, 4000 tokens per rank: rows sized for 4032 tokens (rounded up to 64) from each
    of 8 ranks; bf16 tokens, fp32 probabilities over the domain's 48 experts and fp32 scaling factors per 128 of h
    (intranode.cu L198-201, L213, L255-261), two chunk-flag arrays of 63 x 8 words, the sync words; the scan's
    scratch, 108 blocks x (8 + 6) 8-byte states (L179-191); the gathered routing map, 48 experts x 4032 x 8 bools
    (allgather.cu L142-147)."""
    buffer = hybridep.hybridep_buffer(tokens=4000, hidden=2048, group=8, local_experts=6)
    rows = 4032 * 8
    assert buffer.shared_bytes == (rows * 2048 * 2 + rows * 48 * 4 + rows * 16 * 4 + 2 * 63 * 8 * 4
                                   + 2 * (8 + 8 + 4 + 4))
    assert buffer.preprocessing_bytes == 108 * 14 * 8
    assert buffer.allgather_bytes == 48 * 4032 * 8
    assert buffer.total == buffer.shared_bytes + buffer.preprocessing_bytes + buffer.allgather_bytes


def test_buffers_are_sized_for_at_least_512_tokens():
    """100 tokens per rank, EP 2: the buffer holds 512 per rank (config.cuh L385-387)."""
    small = hybridep.hybridep_buffer(tokens=100, hidden=128, group=2, local_experts=4)
    assert small == hybridep.hybridep_buffer(tokens=512, hidden=128, group=2, local_experts=4)
    assert small.allgather_bytes == 8 * 512 * 2


def _model(backend):
    return SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend,
                           tensor_model_parallel_size=1, expert_model_parallel_size=4)


def test_hybridep_is_modelled_and_ncclep_refused_by_name():
    assert dispatcher.findings(_model("hybridep")) == []
    (finding,) = dispatcher.findings(_model("ncclep"))
    assert finding.setting == "model.moe_flex_dispatcher_backend" and "'ncclep'" in finding.message


LAYERS, TOKENS, TOPK, EXPERTS_N, EP, HIDDEN = 2, 128, 2, 8, 4, 128


def test_hybridep_traces_the_all_to_all_model_plus_what_hybridep_keeps_differently():
    """Qwen3-MoE shrunk (tests/unit/estimate/test_estimate_moe.py: s 128, b 1, h 128, top-2 of 8, TP 1, EP 4, bf16),
    both MoE layers traced with each dispatcher on the balanced load: each local expert receives 32 tokens from each
    of the 4 ranks, 256 pairs per rank, 256 rows on HybridEP (one per pair).

    Per MoE layer, HybridEP keeps its handle (one NVLink domain of 4) where Core's all-to-all permute keeps the
    argsort of the flattened [8, 128] map (int64 [1024], of which it indexes the first 256) and the permutation's
    indices (int64 [256]); Core permutes nothing around HybridEP. The experts keep their probabilities in fp32
    (HybridEP's, hybrid_ep.cu L316) where all-to-all hands them bf16."""
    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.estimate.trace import EXPERTS, MOE_DISPATCH
    from tests.unit.estimate.test_estimate_moe import _tiny

    def traced(dispatcher_type, *extra):
        est = memory.estimate(_tiny(tp=1, ep=EP, dp=4, layers=LAYERS, peft="none", dispatcher=dispatcher_type,
                                    extra=extra))
        return est, est.activations_per_microbatch

    _, alltoall = traced("alltoall")
    est, hybrid = traced("flex", "model.moe_flex_dispatcher_backend=hybridep")
    local = EXPERTS_N // EP
    pairs = EP * math.ceil(TOKENS * TOPK / EXPERTS_N) * local
    handle = (TOKENS * EP * I32 + TOKENS * BOOL + TOKENS * EP * local * (BOOL + I32) + 2 * EP * I32 + local * I32
              + I32)
    assert hybrid[MOE_DISPATCH] - alltoall[MOE_DISPATCH] == LAYERS * (handle - (TOKENS * EXPERTS_N + pairs) * I64)
    assert hybrid[EXPERTS] - alltoall[EXPERTS] == LAYERS * pairs * (FP32 - BF16)
    assert {k: v for k, v in hybrid.items() if k not in (MOE_DISPATCH, EXPERTS)} == \
        {k: v for k, v in alltoall.items() if k not in (MOE_DISPATCH, EXPERTS)}
    assert est.settings.moe.routed_tokens_per_layer == pairs
    buffer = hybridep.hybridep_buffer(tokens=TOKENS, hidden=HIDDEN, group=EP, local_experts=local)
    (line,) = [a for a in est.assumptions if a.startswith("flex dispatcher on HybridEP")]
    assert f"{buffer.total / 2**30:.2f} GiB" in line and "outside PyTorch" in line
    assert not [a for a in est.assumptions if a.startswith("flex dispatcher on DeepEP")]


def _named(ep: int) -> str:
    model = SimpleNamespace(num_moe_experts=64, moe_token_dispatcher_type="flex",
                            moe_flex_dispatcher_backend="hybridep", tensor_model_parallel_size=1, expert_tensor_parallel_size=1,
                            expert_model_parallel_size=ep, hidden_size=2048)
    return hybridep.assumption(model, tokens=4096)


def test_assumption_names_the_buffers_and_what_it_leaves_unsized_across_domains():
    """EP 8 (one domain): the buffers' size, 8 local experts of 64; EP 16 (two domains): the RDMA buffers of a
    multi-node build named as not sized."""
    within = hybridep.hybridep_buffer(tokens=4096, hidden=2048, group=8, local_experts=8)
    assert f"{within.total / 2**30:.2f} GiB" in _named(8) and "RDMA" not in _named(8)
    assert "2 NVLink domains" in _named(16) and "not sized" in _named(16)


OP_FUSER_ALIGN = 256
"""Core rounds the rank budget up to this many rows under the TE op fuser (``get_align_size_for_quantization``,
moe_utils.py L1406-1408), which the budget needs on HybridEP."""


def _budget_rows(tokens: int, topk: int, factor: float) -> int:
    """Core's rank budget: tokens x top-k x factor, rounded up to the alignment (token_dispatcher.py L1095-1102)."""
    return -(-int(tokens * topk * factor) // OP_FUSER_ALIGN) * OP_FUSER_ALIGN


def test_cores_manager_hands_the_experts_the_budgets_rows_and_the_counts_it_received():
    """96 tokens top-2 of 8 experts over 4 ranks, factor 1.5: Core passes the budget, 288 rounded up to 512 rows, as
    HybridEP's permuted-token count; the experts get 512 rows of hidden states and fp32 probabilities, with counts
    summing to the 192 (token, local expert) pairs that arrived; the handle keeps the dispatched-token count on the
    device (non-blocking)."""
    t, g, local, topk, h = 96, 4, 2, 2, 16
    model = SimpleNamespace(moe_router_topk=topk, num_moe_experts=g * local)
    with hybridep.hybridep_kernels(RoutedLoad(), model):
        manager = _manager(t, g, local, topk, budget=1.5)
        manager.over_budget = torch.zeros(1, dtype=torch.bool)  # Core's flag on the CPU the test runs on
        x = torch.zeros(t, h, dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(t, g * local, dtype=torch.bfloat16, requires_grad=True)
        manager.setup_metadata(torch.zeros(t, g * local, dtype=torch.bool), probs)
        hidden, recv_probs = manager.get_permuted_hidden_states_by_experts(manager.dispatch(x))
        counts = manager.get_number_of_tokens_per_expert().tolist()
    rows = _budget_rows(t, topk, 1.5)
    assert tuple(hidden.shape) == (rows, h) and tuple(recv_probs.shape) == (rows,)
    assert counts == [g * math.ceil(t * topk / (g * local))] * local and sum(counts) == 192
    assert len(manager.handle) == 11 and manager.handle[3] is not None


def test_hybrideps_scan_fills_the_budget_in_expert_order_and_drops_the_rest():
    """Three local experts of 100 rows each (25 from each of 4 ranks): a 256-row limit keeps 100, 100, then the 56
    left; padded to 64, each expert takes 128 rows, so the third finds the 256 taken and keeps none; no limit keeps
    all (hybrid_ep_backend.cuh L5194-5220)."""
    layout = hybridep.Layout(tokens=50, ranks=4, local_experts=3)
    assert hybridep._permuted_counts(25, layout, None, 256) == [100, 100, 56]
    assert hybridep._permuted_counts(25, layout, 64, 256) == [128, 128, 0]
    assert hybridep._permuted_counts(25, layout, 64, None) == [128, 128, 128]


def _fp8(fp8):
    return SimpleNamespace(**vars(_model("hybridep")), moe_expert_rank_capacity_factor=1.5, fp8=fp8, fp4=None)


def test_the_rank_budget_is_modelled_on_bf16_experts_and_refused_by_name_on_fp8_ones():
    """TE's op fuser quantises the budget's rows as one grouped tensor (grouped_linear.py L1372-1378), which the FP8
    experts' contract does not count."""
    assert dispatcher.findings(_fp8(None)) == []
    [finding] = dispatcher.findings(_fp8("hybrid"))
    assert finding.setting == "model.moe_expert_rank_capacity_factor" and "FP8" in finding.message


FACTOR = 1.5
PER_ROW = (HIDDEN + 6 * 64) * BF16 + FP32
"""What the traced local experts keep per row (tests/unit/estimate/features/test_moe_act.py): fc1's input [h], its
output [2 x moe_ffn], SwiGLU's three unfused saves [moe_ffn each] and fc2's input [moe_ffn] in bf16 (moe_ffn 64 in
the tiny model), and HybridEP's fp32 probability. TE's op fuser keeps fc1's input, its output (the scaled SwiGLU's
input) and fc2's input on every row the experts receive too (grouped_linear.py L1381-1389, L1479; swiglu.py
L552-555)."""
STASH = ("model.moe_flex_dispatcher_backend=hybridep", "model.use_transformer_engine_op_fuser=true")


def _stash_estimate(*extra):
    from megatron_bridge_ext.estimate import memory
    from tests.unit.estimate.test_estimate_moe import _tiny

    return memory.estimate(_tiny(tp=1, ep=EP, dp=4, layers=LAYERS, peft="none", dispatcher="flex",
                                 extra=STASH + extra))


def test_a_stash_config_is_estimated_with_the_experts_on_the_budgets_rows():
    """The tiny MoE model on HybridEP under the TE op fuser, with and without the rank budget (factor 1.5) and the
    paged stash it enables (transformer_config.py L1904-1911): without, each MoE layer's experts keep the 256
    (token, local expert) pairs' rows; with, the budget's 128 x 2 x 1.5 = 384 rows rounded up to 512, as many as
    TE keeps, and the rows the experts receive (their backward gradients' rows) are the budget's; the stash takes
    nothing (no saved tensor is stamped for it) and HybridEP's handle adds the dispatched-token count on the device
    [1] int32."""
    from megatron_bridge_ext.estimate.trace import EXPERTS, MOE_DISPATCH

    plain = _stash_estimate()
    stashed = _stash_estimate(f"model.moe_expert_rank_capacity_factor={FACTOR}", "model.moe_paged_stash=true")
    pairs, rows = EP * math.ceil(TOKENS * TOPK / EXPERTS_N) * (EXPERTS_N // EP), _budget_rows(TOKENS, TOPK, FACTOR)
    assert plain.activations_per_microbatch[EXPERTS] == LAYERS * pairs * PER_ROW
    assert stashed.activations_per_microbatch[EXPERTS] == LAYERS * rows * PER_ROW
    assert stashed.activations_per_microbatch[MOE_DISPATCH] - plain.activations_per_microbatch[MOE_DISPATCH] == \
        LAYERS * I32
    assert (plain.settings.moe.routed_tokens_per_layer, stashed.settings.moe.routed_tokens_per_layer) == (pairs, rows)
    assert any("0 B for the stash" in line for line in stashed.assumptions)
    (line,) = [a for a in stashed.assumptions if a.startswith("flex dispatcher on HybridEP")]
    assert f"rank budget's {rows:,} rows (tokens x top-k x {FACTOR}" in line and "one row per" not in line
