"""Core's ``flex`` token dispatcher on HybridEP: stand-ins for HybridEP's dispatch and combine, and its buffers.

``MoEFlexTokenDispatcher`` with ``moe_flex_dispatcher_backend="hybridep"`` (``token_dispatcher.py`` L1779-1785) runs
``_HybridEPManager`` (L993-1213): ``setup_metadata`` keeps the TP-replicated ``[tokens, experts]`` routing map and
probabilities, ``dispatch`` casts the probabilities to fp32 (L1127-1135) and calls ``hybrid_ep_dispatch``
(``fused_a2a.py`` ``HybridEPDispatch``, L357-474), whose one call permutes, dispatches and permutes again: the experts
get its output as it is (``get_permuted_hidden_states_by_experts``, L1203-1204, no permute of Core's own), and
``combine`` calls ``hybrid_ep_combine`` (``HybridEPCombine``, L477-514). Neither function calls
``save_for_backward``: both keep HybridEP's ``handle`` on ``ctx`` (L436, L494) until their backward, so while tracing
(:func:`hybridep_kernels`) the stand-ins :class:`_DispatchSaves` / :class:`..flex.CombineSaves` save the handle's device
tensors (:func:`handle_shapes`). The rows the experts receive are the stated load's (:class:`..routing.RoutedLoad`):
one per (token, local expert) pair, as HybridEP permutes per expert.

Under HybridEP's static rank budget (``moe_expert_rank_capacity_factor``, which the MoE paged stash needs) Core passes
``tokens x top-k x factor`` rounded up to the alignment (L1095-1102) as HybridEP's permuted-token count: the experts
get that many rows, the counts fill what the load routes (dropping past the budget as HybridEP's scan does), and the
rows beyond the counts are kept by the experts as TE's op fuser keeps them (:func:`_budget_rows_forward`). Only the
experts' activations grow with the budget; the handle is the tokens' (it adds the dispatched-token count on the
device) and HybridEP's own buffers are sized by the tokens per rank, not the budget (:func:`hybridep_buffer`).

HybridEP's buffers (:func:`hybridep_buffer`) are allocated by HybridEP itself, ``cuMemCreate`` (fabric handles) or
``cudaMalloc``, outside PyTorch's caching allocator: the estimate names them in its assumptions
(:func:`assumption`) for the margin to cover, not as a component.

HybridEP sources: github.com/deepseek-ai/DeepEP, branch ``hybrid-ep`` at 94a9f8f: ``deep_ep/hybrid_ep_buffer.py``,
``csrc/hybrid_ep/hybrid_ep.cu``, ``csrc/hybrid_ep/executor/executor.cu``, ``csrc/hybrid_ep/config.cuh``,
``csrc/hybrid_ep/buffer/intranode.cu``, ``csrc/hybrid_ep/extension/allgather.cu``,
``csrc/hybrid_ep/allocator/allocator.cu``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_bridge_ext.estimate.features.flex import CombineSaves
from megatron_bridge_ext.estimate.routing import RoutedLoad, _host_tensor
from megatron_bridge_ext.findings import ERROR, Finding
from megatron_bridge_ext.sizes import GIB

HYBRIDEP = "hybridep"
NVL_DOMAIN = 8
"""Ranks of one NVLink domain assumed (an 8-GPU node). HybridEP counts the group's ranks it can map memory of
(``detect_accessible_ranks``, allocator.cu L178-211); a larger group spans ``group / 8`` domains."""
CHUNK = 64
"""Tokens per chunk of the preprocessing, dispatch and combine kernels (``get_default_config``, config.cuh L419-437;
``BufferConfig``, L383-384)."""
MIN_BUFFER_TOKENS = 512
"""The fewest tokens per rank a buffer is sized for (``Configurer``, config.cuh L385-387)."""
PREPROCESSING_BLOCKS = 108
"""Core's ``moe_hybridep_num_sms_preprocessing`` default (transformer_config.py L949)."""
TMP_STATE_BYTES = 8
"""``sizeof(tmp_state_t)``: an enum and an int32 (hybrid_ep_backend.cuh L84-87)."""
SYNC_BYTES = 2 * (2 * 4 + 2 * 4 + 4 + 4)
"""The dispatch and combine synchronisation words on local rank 0 (intranode.cu L216-227, L264-275)."""


def used(model) -> bool:
    flex = getattr(model, "moe_token_dispatcher_type", None) == "flex"
    return bool(getattr(model, "num_moe_experts", None)) and flex and model.moe_flex_dispatcher_backend == HYBRIDEP


def budget(model) -> Optional[float]:
    """HybridEP's static rank budget, ``moe_expert_rank_capacity_factor`` (None: HybridEP sizes the experts' input to
    the rows it received, token_dispatcher.py L1166-1169)."""
    return getattr(model, "moe_expert_rank_capacity_factor", None)


def budget_rows(model, tokens: int) -> int:
    """The rows Core's budget gives the experts for ``tokens`` per rank: tokens x top-k x factor, rounded up to the
    quantisation alignment, 256 under the TE op fuser the budget needs (token_dispatcher.py L1090-1102, Core's own
    ``get_align_size_for_quantization``, moe_utils.py L1397-1414)."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    rows = int(tokens * model.moe_router_topk * budget(model))
    return _align(rows, get_align_size_for_quantization(model) or 1)


def findings(model) -> list[Finding]:
    """The rank budget on FP8 or FP4 experts: TE quantises the budget's rows as one grouped tensor
    (``tex.group_quantize``, TE d0067d0d ``ops/basic/grouped_linear.py`` L1372-1378), or splits them by the counts,
    which do not fill it (``tex.split_quantize``, L1222-1244), where the FP8 experts' contract (:mod:`.fp8_experts`)
    counts each expert's routed rows."""
    if budget(model) is None or not (getattr(model, "fp8", None) or getattr(model, "fp4", None)):
        return []
    return [Finding("unsupported_model", ERROR, "model.moe_expert_rank_capacity_factor",
                    "HybridEP's rank budget on FP8/FP4 experts is not modelled by the estimate: TE's op fuser "
                    "quantises the budget's rows (TE d0067d0d ops/basic/grouped_linear.py L1372-1378), the estimate's "
                    "FP8 experts count the routed rows",
                    "estimate with the experts in bf16 (the budget's rows are modelled there), then add the FP8 "
                    "inputs' difference")]


def ranks(model) -> int:
    """The flex dispatcher's group: expert-TP x EP ranks (``tp_ep_group``, token_dispatcher.py L1779-1783)."""
    etp = getattr(model, "expert_tensor_parallel_size", None) or model.tensor_model_parallel_size
    return etp * model.expert_model_parallel_size


@dataclass(frozen=True)
class Layout:
    """One dispatch: ``tokens`` on each rank of ``ranks``, each holding ``local_experts``; the group in NVLink domains
    of :data:`NVL_DOMAIN` (``num_of_ranks_per_node`` x ``num_of_nodes``, hybrid_ep_buffer.py L61-83)."""

    tokens: int
    ranks: int
    local_experts: int

    @property
    def per_node(self) -> int:
        return min(self.ranks, NVL_DOMAIN)

    @property
    def nodes(self) -> int:
        return self.ranks // self.per_node


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


def handle_shapes(layout: Layout, non_blocking: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The device tensors of the handle ``metadata_preprocess_core`` makes with permute (executor.cu L89-133), which
    Core keeps until backward: ``sparse_to_dense_map`` [T x nodes, per node] int32, ``rdma_to_attn_map``
    [T rounded up to 16, nodes] bool, ``attn_to_rdma_map`` [T, nodes - 1] bool, ``local_expert_routing_map`` and
    ``dense_to_expert_map`` [T x ranks, local experts] bool and int32, ``dense_chunk_layout`` [chunks of 64 x ranks]
    int32, ``tokens_per_expert`` [local experts] int32 and ``overflow_flag`` [1] int32. ``num_dispatched_tokens_tensor``
    [1] int32 is on the device only ``non_blocking`` (Core passes a permuted-token count, fused_a2a.py L416); else it is
    pinned host memory (L103-109) and left out."""
    t, g, e, n = layout.tokens, layout.ranks, layout.local_experts, layout.nodes
    i32, bool_ = torch.int32, torch.bool
    shapes = [((t * n, layout.per_node), i32), ((_align(t, 16), n), bool_), ((t, n - 1), bool_),
              ((t * g, e), bool_), ((math.ceil(t / CHUNK) * g,), i32), ((t * g, e), i32), ((e,), i32), ((1,), i32)]
    return shapes + ([((1,), i32)] if non_blocking else [])


def handle_bytes(layout: Layout, non_blocking: bool) -> int:
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in handle_shapes(layout, non_blocking))


class _DispatchSaves(torch.autograd.Function):
    """HybridEP's ``dispatch_with_permute`` (hybrid_ep.cu L267-335): ``[permuted, hidden]`` rows in the input's dtype
    and their fp32 probabilities ``[permuted]`` (L313-317); saves the handle's device tensors (Core keeps the handle on
    ``ctx``, fused_a2a.py L436). Its backward gives the probabilities' gradient ``[tokens, experts]`` in fp32
    (``combine_with_unpermute``, hybrid_ep.cu L363-366)."""

    @staticmethod
    def forward(ctx, x, probs, layout: Layout, permuted: int, non_blocking: bool):
        handle = tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in handle_shapes(layout, non_blocking))
        ctx.save_for_backward(*handle)
        ctx.mark_non_differentiable(*handle)
        ctx.inputs = x.new_empty(0), probs.new_empty(0), tuple(x.shape), tuple(probs.shape)
        return (x.new_empty(permuted, x.shape[1]), probs.new_empty(permuted, dtype=torch.float)) + handle

    @staticmethod
    def backward(ctx, grad_x, grad_probs, *grad_handle):
        x_like, probs_like, x_shape, probs_shape = ctx.inputs
        return x_like.new_zeros(x_shape), probs_like.new_zeros(probs_shape), None, None, None


def _as_handle(layout: Layout, tensors: tuple, non_blocking: bool) -> tuple:
    """HybridEP's 11-entry handle (hybrid_ep_buffer.py L419-431): the tensors, the tokens per rank and the config
    (None here), ``overflow_flag`` last (Core reads ``handle[-1]``, token_dispatcher.py L1159-1161)."""
    s2d, r2a, a2r, routing, chunks, d2e, per_expert, overflow, *dispatched = tensors
    return (s2d, r2a, a2r, dispatched[0] if non_blocking else None, routing, chunks, d2e, per_expert,
            layout.tokens, None, overflow)


def _permuted_counts(each: int, layout: Layout, pad_multiple: Optional[int], limit: Optional[int]) -> list[int]:
    """Rows per local expert: ``each`` from every rank, padded to ``pad_multiple`` (``pad_tokens_per_expert``,
    executor.cu L148-163). Under a permuted-token ``limit`` (Core's rank budget) HybridEP's scan keeps each expert's
    rows only where the padded rows of the experts before it leave room, in expert order, and drops the rest
    (``metadata_preprocessing``, hybrid_ep_backend.cuh L5194-5220; built in when a limit is passed, compiler.cu
    L132-134)."""
    rows = each * layout.ranks

    def padded(n: int) -> int:
        return _align(n, pad_multiple) if pad_multiple else n

    return [padded(rows if limit is None else max(0, min(rows, limit - expert * padded(rows))))
            for expert in range(layout.local_experts)]


def _hybrid_ep_dispatch(load: RoutedLoad, topk: int, experts: int):
    def hybrid_ep_dispatch(x, routing_map, probs, group, num_local_experts, num_sms_dispatch_api=None,
                           num_sms_combine_api=None, num_blocks_permute=None, num_blocks_unpermute=None, fused=False,
                           num_permuted_tokens=None, pad_multiple=None, num_sms_preprocessing_api=108):
        """Core's ``hybrid_ep_dispatch`` (fused_a2a.py L519-583) on the stated load: ``routing_map`` holds each
        expert once per expert-TP rank, so a token's top-k counts as many times. Given ``num_permuted_tokens`` (the
        rank budget, or drop-and-pad's capacity), the experts' rows are that many, whatever the counts fill
        (``local_expert_output_token``, hybrid_ep.cu L312-314): the load records those rows, which the experts'
        backward gradients have too."""
        layout = Layout(x.shape[0], group.size(), num_local_experts)
        each = load.per_expert(x.shape[0], topk * routing_map.shape[1] // experts, routing_map.shape[1])
        counts = _permuted_counts(each, layout, pad_multiple, num_permuted_tokens)
        permuted = sum(counts) if num_permuted_tokens is None else num_permuted_tokens
        load.routed_tokens.append(permuted)
        non_blocking = num_permuted_tokens is not None
        hidden, recv_probs, *handle = _DispatchSaves.apply(x.contiguous(), probs, layout, permuted, non_blocking)
        return hidden, recv_probs, None, _host_tensor(counts), _as_handle(layout, tuple(handle), non_blocking)

    return hybrid_ep_dispatch


def _hybrid_ep_combine(x, handle, num_permuted_tokens, pad_multiple, fused=False):
    """Core's ``hybrid_ep_combine`` (fused_a2a.py L584-602): back to the tokens the dispatch took."""
    return CombineSaves.apply(x, handle[-3], *(t for t in handle if isinstance(t, torch.Tensor)))


def _budget_rows_forward(forward):
    """``SequentialMLP.forward`` on all the rows HybridEP hands the experts under the rank budget.

    Core hands ``TEGroupedMLP`` the budget's rows whole with the counts (HybridEP pads nothing else: quantisation
    padding is skipped, experts.py L637-638), and its fused forward gives them whole to TE's op fuser (L702-708).
    TE's grouped-tensor path (the only one whose splits need not fill the input: the legacy one splits it by the
    counts with ``torch.split``, TE d0067d0d ``ops/basic/grouped_linear.py`` L1246) multiplies only the counts'
    rows (``first_dims``) but wraps and saves the whole input (L1381-1389, L1479) and allocates the whole
    output (L1416-1426); the scaled SwiGLU saves its whole input and scales (``ops/basic/swiglu.py`` L552-555), so
    fc1's input and output and fc2's input keep the budget's rows, counted or not. The traced local experts split
    the rows by the counts (experts.py L1352-1354): the rows beyond the counts go to the last expert, so the traced
    experts keep as many rows as TE does."""

    def on_budget_rows(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        counts = tokens_per_expert.tolist()
        counts[-1] += permuted_local_hidden_states.shape[0] - sum(counts)
        return forward(self, permuted_local_hidden_states, _host_tensor(counts), permuted_probs)

    return on_budget_rows


@contextlib.contextmanager
def hybridep_kernels(load: RoutedLoad, model) -> Iterator[None]:
    """Build and trace ``_HybridEPManager`` with the stand-ins above (Core checks for HybridEP when it builds the
    manager, token_dispatcher.py L1047-1051), and under the rank budget the local experts on its rows
    (:func:`_budget_rows_forward`); restores Core on exit."""
    from unittest import mock

    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.moe.experts import SequentialMLP

    rank_budget = budget(model) is not None
    with mock.patch.object(td, "hybrid_ep_dispatch", _hybrid_ep_dispatch(load, model.moe_router_topk,
                                                                           model.num_moe_experts)), \
            mock.patch.object(td, "hybrid_ep_combine", _hybrid_ep_combine), \
            (mock.patch.object(SequentialMLP, "forward", _budget_rows_forward(SequentialMLP.forward))
             if rank_budget else contextlib.nullcontext()):
        yield


@dataclass(frozen=True)
class HybridEpBuffer:
    """What one ``HybridEPBuffer`` holds on the device, by HybridEP's allocator (``cuMemCreate`` with fabric handles,
    rounded up to its granularity, else ``cudaMalloc``, allocator.cu L87-98) and ``cudaMalloc``."""

    shared_bytes: int
    """The expert token and probability buffers, which dispatch and combine share (intranode.cu L204-208, L253-261),
    the FP8 scaling factors (L213), the chunk flags (L229-230, L277-278) and the synchronisation words."""
    preprocessing_bytes: int
    """The metadata scan's scratch (intranode.cu L179-191)."""
    allgather_bytes: int
    """The gathered routing map (allgather.cu L142-147)."""

    @property
    def total(self) -> int:
        return self.shared_bytes + self.preprocessing_bytes + self.allgather_bytes


def hybridep_buffer(*, tokens: int, hidden: int, group: int, local_experts: int,
                    preprocessing_blocks: int = PREPROCESSING_BLOCKS) -> HybridEpBuffer:
    """Core's ``init_hybrid_ep_buffer`` (fused_a2a.py L284-344): one buffer per process for the first dispatch's
    tokens per rank, at least 512 and rounded up to the 64-token chunk (config.cuh L385-391, L466-468), times the
    group's ranks (the worst case, every token to one rank: intranode.cu L126-130), in bf16 (L260)."""
    layout = Layout(tokens, group, local_experts)
    per_rank = _align(max(tokens, MIN_BUFFER_TOKENS), CHUNK)
    rows = per_rank * layout.ranks
    node_experts = local_experts * layout.per_node
    chunks = per_rank // CHUNK * layout.ranks
    shared = rows * hidden * 2 + rows * node_experts * 4 + rows * (hidden // 128) * 4 + 2 * chunks * 4 + SYNC_BYTES
    preprocessing = preprocessing_blocks * (layout.per_node + local_experts) * TMP_STATE_BYTES
    allgather = local_experts * layout.ranks * per_rank * layout.ranks
    return HybridEpBuffer(shared, preprocessing, allgather)


def assumption(model, *, tokens: int) -> Optional[str]:
    """The flex dispatcher on HybridEP as traced, and HybridEP's buffers for ``tokens`` per rank, which the margin
    must hold (they are outside PyTorch's allocator); None without it."""
    if not used(model):
        return None
    group, local = ranks(model), model.num_moe_experts // model.expert_model_parallel_size
    blocks = getattr(model, "moe_hybridep_num_sms_preprocessing", None) or PREPROCESSING_BLOCKS
    buffer = hybridep_buffer(tokens=tokens, hidden=model.hidden_size, group=group, local_experts=local,
                             preprocessing_blocks=blocks)
    internode = (f"; across its {group // NVL_DOMAIN} NVLink domains HybridEP's RDMA buffers (HYBRID_EP_MULTINODE "
                 "builds) come on top, not sized" if group > NVL_DOMAIN else "")
    rows = (f"the rank budget's {budget_rows(model, tokens):,} rows (tokens x top-k x {budget(model)} rounded up, "
            "token_dispatcher.py L1095-1102), kept whole by the experts as TE's op fuser keeps them, whatever the "
            "routed tokens fill" if budget(model) is not None else "one row per (token, local expert) pair")
    return (f"flex dispatcher on HybridEP: stand-ins for its dispatch and combine keep the handle's tensors "
            f"(DeepEP hybrid-ep 94a9f8f), {rows} (estimate.features.hybridep); "
            f"HybridEP's buffers for the group of {group} (NVLink domains of {NVL_DOMAIN} assumed) are outside "
            f"PyTorch's allocator, so neither in this estimate nor in torch's max_memory_allocated, yet on the "
            f"device: {buffer.total / GIB:.2f} GiB by HybridEP's allocator and cudaMalloc (expert buffers "
            f"{buffer.shared_bytes / GIB:.2f} GiB, gathered routing map {buffer.allgather_bytes / GIB:.2f} GiB)"
            f"{internode}; the margin must hold it")
