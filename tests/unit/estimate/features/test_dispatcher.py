"""The token dispatchers in the estimate: ``flex`` on DeepEP traced with stand-ins for DeepEP's kernels.

What the stand-ins save is checked against DeepEP's handle shapes (deep_ep v1.2.1 ``buffer.py`` / ``deep_ep.cpp``)
and against Core's own ``_indices_to_multihot`` on CPU tensors; DeepEP's buffer against ``config.hpp``'s size hints;
a tiny MoE model traced with ``flex`` against the same model with Core's all-to-all dispatcher, plus what the two
paths keep differently, derived from shapes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate.features import dispatcher, flex
from megatron_bridge_ext.measure.saved import SavedActivationMeter

pytestmark = [pytest.mark.unit]

I32, I64, BOOL, FP32, BF16 = 4, 8, 1, 4, 2


def _saved_bytes(run) -> int:
    with SavedActivationMeter() as meter:
        run()
    return meter.result().total_bytes


def _dispatch_saves(tokens: int, ranks: int, per_expert: int, local: int, sms: int) -> int:
    received = flex.Received(tokens, per_expert, ranks, local)
    x = torch.zeros(tokens, 16, requires_grad=True)
    probs = torch.zeros(tokens, 2, requires_grad=True)
    return _saved_bytes(lambda: flex._DispatchSaves.apply(x, torch.zeros(tokens, 2, dtype=torch.long), probs,
                                                          received, sms))


def test_intranode_dispatch_saves_deepeps_handle():
    """Four ranks, 10 channels (20 SMs), 64 tokens, 8 per local expert of 3: each source sends min(64, 24) rows.
    The handle (buffer.py L383): rank prefix [4, 4], channel prefixes 2 x [4, 10] int32, received source indices
    [96] int32, is_token_in_rank [64, 4] bool, send_head [64, 4] int32."""
    t, g, c, r = 64, 4, 10, 4 * 24
    expected = g * g * I32 + 2 * g * c * I32 + r * I32 + t * g * BOOL + t * g * I32
    assert _dispatch_saves(t, g, per_expert=8, local=3, sms=2 * c) == expected


def test_internode_dispatch_saves_deepeps_handle():
    """Sixteen ranks (two NVLink domains of 8), 10 channels, 64 tokens, 2 per local expert of 2: each source sends
    min(64, 4) rows, each node's ranks min(64, 32). The handle (buffer.py L479-482, deep_ep.cpp L794-797,
    L851-855)."""
    t, g, n, c = 64, 16, 2, 10
    r, r_rdma = g * 4, n * 32
    expected = (t * g * BOOL + 2 * n * c * I32 + 2 * g * c * I32 + n * I32 + g * I32 + r * 8
                + t * n * I32 + r_rdma * 8 * I32)
    assert _dispatch_saves(t, g, per_expert=2, local=2, sms=2 * c) == expected


def test_multihot_standin_saves_what_cores_conversion_saves():
    """Core's ``_DeepepManager._indices_to_multihot`` run on CPU tensors under the meter against the stand-in told
    the same number of received (row, expert) pairs."""
    from megatron.core.transformer.moe.token_dispatcher import _DeepepManager

    indices = torch.tensor([[0, -1], [1, 2], [-1, -1], [2, 0], [1, -1], [0, 1]])
    probs = torch.rand(6, 2, requires_grad=True)
    owner = SimpleNamespace(num_local_experts=3)
    core = _saved_bytes(lambda: _DeepepManager._indices_to_multihot(owner, indices, probs))
    pairs = int((indices != -1).sum())
    standin = _saved_bytes(lambda: flex._MultihotSaves.apply(indices, probs, 3, pairs))
    assert standin == core == indices.numel() * BOOL + 2 * pairs * I64


def _nvl_hint(channels, nvl_ranks, rdma_ranks, recv, hidden_bytes):
    """config.hpp L45-67 written out: counters, then per slot the hidden vector, source meta (8 B), 128 int64
    indices, 128 fp32 weights, 128 fp32 scales; rounded up to 128 B."""
    size = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
    size += channels * nvl_ranks * recv * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    return -(-size // 128) * 128


def test_deepep_buffer_within_one_nvlink_domain():
    """EP 8, h 7168 in bf16, 24 SMs: the dispatch and combine configs both receive 256-token chunks (buffer.py
    L234, L262); no RDMA buffer; cudaMalloc adds 8 barrier ints and 16 peer pointers and the 32 MiB workspace."""
    buffer = flex.deepep_buffer(ranks=8, hidden=7168, element=BF16, sms=24)
    assert buffer.num_nvl_bytes == _nvl_hint(12, 8, 1, 256, 7168 * 2)
    assert buffer.num_rdma_bytes == 0
    assert buffer.cuda_malloc_bytes == buffer.num_nvl_bytes + 8 * 4 + 16 * 8 + 32 * 2**20


def test_deepep_buffer_across_nvlink_domains():
    """EP 16 (two domains), h 4096 in fp32 (4 B kept: Core's hidden bytes are h x max(element, 2)), 20 SMs: NVL
    receive chunks 288 (both configs); RDMA receive 128 rounded up to the send chunk, 20 for dispatch (140) and 12
    for combine (132), the larger kept; per slot twice the NVL slot plus an int4 (config.hpp L69-93)."""
    buffer = flex.deepep_buffer(ranks=16, hidden=4096, element=FP32, sms=20)
    hidden_bytes, channels, rdma_ranks = 4096 * 4, 10, 2
    assert buffer.num_nvl_bytes == _nvl_hint(channels, 8, rdma_ranks, 288, hidden_bytes)
    rdma = channels * rdma_ranks * 18 * 2 * 4
    rdma += channels * rdma_ranks * 140 * 2 * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16)
    assert buffer.num_rdma_bytes == -(-rdma // 128) * 128
    assert buffer.total == buffer.cuda_malloc_bytes + buffer.num_rdma_bytes


def _model(backend="deepep", tp=1, ep=4):
    return SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend,
                           tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


def test_flex_on_deepep_is_modelled_and_ncclep_is_refused_by_name():
    assert dispatcher.findings(_model()) == []
    (finding,) = dispatcher.findings(_model("ncclep"))
    assert finding.setting == "model.moe_flex_dispatcher_backend" and "'ncclep'" in finding.message
    (finding,) = dispatcher.findings(_model(tp=3, ep=4))
    assert "12 ranks" in finding.message and finding.setting == "model.expert_model_parallel_size"


LAYERS, TOKENS, TOPK, EXPERTS_N, EP = 2, 128, 2, 8, 4


def test_flex_traces_the_all_to_all_model_plus_what_deepep_keeps_differently():
    """Qwen3-MoE shrunk (tests/unit/estimate/test_estimate_moe.py: s 128, b 1, top-2 of 8, TP 1, EP 4, bf16), both
    MoE layers traced with each dispatcher on the balanced load: each local expert receives 128 x 2 / 8 = 32
    tokens from each of the 4 ranks, 256 pairs per rank, which on DeepEP arrive as 4 x min(128, 64) = 256 rows.

    Per MoE layer, flex keeps besides: the top-k indices of ``setup_metadata`` [128, 2] int64; DeepEP's handle
    (intranode, 10 channels); the multihot conversion's mask [256, 2] bool and two int64 [256]; its permutation
    sorts a [256, 2] map (argsort int64 [512]) where the all-to-all one sorts [128, 8] ([1024]); the experts keep
    their probabilities in fp32 (DeepEP's, token_dispatcher.py L1306-1309) where all-to-all hands them bf16."""
    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.estimate.trace import EXPERTS, MOE_DISPATCH
    from tests.unit.estimate.test_estimate_moe import _tiny

    def traced(dispatcher_type, *extra):
        est = memory.estimate(_tiny(tp=1, ep=EP, dp=4, layers=LAYERS, peft="none", dispatcher=dispatcher_type,
                                    extra=extra))
        return est, est.activations_per_microbatch

    _, alltoall = traced("alltoall")
    est, deepep = traced("flex", "model.moe_flex_dispatcher_backend=deepep")
    local = EXPERTS_N // EP
    each = math.ceil(TOKENS * TOPK / EXPERTS_N)
    rows = pairs = EP * min(TOKENS, each * local)
    handle = EP * EP * I32 + 2 * EP * 10 * I32 + rows * I32 + TOKENS * EP * (BOOL + I32)
    per_layer = (TOKENS * TOPK * I64 + handle + rows * TOPK * BOOL + 2 * pairs * I64
                 + (rows * local - TOKENS * EXPERTS_N) * I64)
    assert deepep[MOE_DISPATCH] - alltoall[MOE_DISPATCH] == LAYERS * per_layer
    assert deepep[EXPERTS] - alltoall[EXPERTS] == LAYERS * pairs * (FP32 - BF16)
    assert {k: v for k, v in deepep.items() if k not in (MOE_DISPATCH, EXPERTS)} == \
        {k: v for k, v in alltoall.items() if k not in (MOE_DISPATCH, EXPERTS)}
    assert est.settings.moe.routed_tokens_per_layer == pairs
    buffer = flex.deepep_buffer(ranks=EP, hidden=128, element=BF16, sms=20)
    (line,) = [a for a in est.assumptions if a.startswith("flex dispatcher on DeepEP")]
    assert f"{buffer.cuda_malloc_bytes / 2**30:.2f} GiB by cudaMalloc" in line and "outside PyTorch" in line
