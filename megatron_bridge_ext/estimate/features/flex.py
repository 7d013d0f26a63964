"""Core's ``flex`` token dispatcher on DeepEP: stand-ins for DeepEP's fused dispatch and combine, and its buffer.

``MoEFlexTokenDispatcher`` with ``moe_flex_dispatcher_backend="deepep"`` (``token_dispatcher.py`` L1773-1781) runs
``_DeepepManager``: the router's top-k of the TP-replicated routing map (``setup_metadata``, L1285-1295, a
``torch.topk`` that keeps its indices), DeepEP's fused dispatch (``fused_a2a.py`` ``FusedDispatch``, L71-139), Core's
own conversion of the received expert indices to a multihot map (``_indices_to_multihot``, L1328-1356) and
permutation (``permute``, L1415-1448), the experts, Core's ``unpermute`` (L1450-1459) and DeepEP's fused combine
(``FusedCombine``, L165-190). DeepEP's kernels do not run here; while tracing (:func:`deepep_kernels`):

* ``fused_dispatch`` / ``fused_combine`` are :class:`_DispatchSaves` / :class:`CombineSaves`. Core's functions call
  no ``save_for_backward``: they keep DeepEP's ``handle`` on ``ctx`` (L133-136, L186-189) until their backward, so the
  stand-ins save the handle's tensors, whose shapes DeepEP's ``Buffer`` gives (:func:`handle_shapes`). The tokens
  a rank receives are the stated load's (:class:`..routing.RoutedLoad`), with no two of a token's top-k experts on one
  rank (DeepEP sends a token once per rank: an upper bound).
* ``_indices_to_multihot`` is :class:`_MultihotSaves`: Core's boolean indexing has data-dependent sizes; the
  stand-in keeps what Core's ops keep (the ``[R, top-k]`` mask, the row and expert indices of the received pairs).
* ``set_deepep_num_sms`` does nothing (there is no ``Buffer`` class to set).

DeepEP's communication buffer (:func:`deepep_buffer`) is allocated by DeepEP itself, ``cudaMalloc`` and NVSHMEM,
outside PyTorch's caching allocator: it takes device memory that torch's ``max_memory_allocated`` does not show,
so the estimate names it in its assumptions (:func:`assumption`) for the margin to cover, not as a component.

DeepEP sources: github.com/deepseek-ai/DeepEP v1.2.1 (9af0e0d), ``deep_ep/buffer.py`` and ``csrc/deep_ep.cpp``,
``csrc/config.hpp``, ``csrc/kernels/configs.cuh``, ``csrc/kernels/internode.cu``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_bridge_ext.estimate.routing import RoutedLoad, _host_tensor
from megatron_bridge_ext.findings import ERROR, Finding
from megatron_bridge_ext.sizes import GIB

DEEPEP = "deepep"
NVL_PEERS = 8
"""``NUM_MAX_NVL_PEERS`` (configs.cuh L3): ranks one NVLink domain holds; above it DeepEP goes internode."""
WORKSPACE_BYTES = 32 * 1024 * 1024
"""``NUM_WORKSPACE_BYTES`` (configs.cuh L5), the workspace every ``Buffer`` allocates (deep_ep.cpp L62)."""
SOURCE_META_BYTES = 8
"""``sizeof(SourceMeta)``: two ints (internode.cu L17-18, L40-42)."""
MAX_TOPK = MAX_SCALES = 128
"""``kNumMaxTopK`` and ``kNumMaxScales`` of the buffer size hints (config.hpp L48-49, L77-78)."""
DEFAULT_SMS = 20
"""Core's SM count for DeepEP when ``moe_flex_dispatcher_num_sms`` is unset (token_dispatcher.py L1276-1281)."""
ALIGN = 128
"""The hints' rounding (config.hpp L65, L92; ``NUM_BUFFER_ALIGNMENT_BYTES``, configs.cuh L7)."""

# ``Buffer.get_dispatch_config`` / ``get_combine_config`` (buffer.py L220-274): per EP size, the chunked tokens
# (NVL send, NVL receive, RDMA send, RDMA receive) after the SM count.
DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                    24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
                    144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                   24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
                   144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def used(model) -> bool:
    flex = getattr(model, "moe_token_dispatcher_type", None) == "flex"
    return bool(getattr(model, "num_moe_experts", None)) and flex and model.moe_flex_dispatcher_backend == DEEPEP


def ranks(model) -> int:
    """The flex dispatcher's group: TP x EP ranks (``tp_ep_group``, token_dispatcher.py L1773-1777)."""
    return model.tensor_model_parallel_size * model.expert_model_parallel_size


def findings(model) -> list[Finding]:
    """DeepEP's layouts the estimate cannot size: a group DeepEP has no config for (buffer.py L236, L264)."""
    group = ranks(model)
    if group in DISPATCH_CONFIGS:
        return []
    return [Finding("parallel_layout", ERROR, "model.expert_model_parallel_size",
                    f"DeepEP has no dispatch config for a TP x EP group of {group} ranks (deep_ep buffer.py "
                    f"get_dispatch_config: {', '.join(map(str, DISPATCH_CONFIGS))})",
                    "choose TP x EP among those, or estimate with model.moe_token_dispatcher_type=alltoall")]


def num_sms(model) -> int:
    sms = getattr(model, "moe_flex_dispatcher_num_sms", None)
    return DEFAULT_SMS if sms is None else sms


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


def nvl_hint(recv_tokens: int, hidden_bytes: int, ranks: int, sms: int) -> int:
    """``Config::get_nvl_buffer_size_hint`` (config.hpp L45-67), NVSHMEM compiled in: per channel and NVLink peer,
    counters and ``recv_tokens`` chunked slots of the hidden vector, source meta, 128 top-k indices and weights and
    128 scales."""
    rdma_ranks, nvl_ranks, channels = max(ranks // NVL_PEERS, 1), min(ranks, NVL_PEERS), sms // 2
    slots = channels * nvl_ranks * recv_tokens
    size = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
    size += slots * (hidden_bytes + SOURCE_META_BYTES + MAX_TOPK * 8 + MAX_TOPK * 4 + MAX_SCALES * 4)
    return _align(size, ALIGN)


def rdma_hint(send_tokens: int, recv_tokens: int, hidden_bytes: int, ranks: int, sms: int) -> int:
    """``Config::get_rdma_buffer_size_hint`` (config.hpp L69-93): 0 within one NVLink domain; else per channel and
    RDMA peer, twice (send and receive) the slots of :func:`nvl_hint` plus an int4 each. ``recv_tokens`` is first
    rounded up to a multiple of ``send_tokens`` (the ``Config`` constructor, L39)."""
    if ranks <= NVL_PEERS:
        return 0
    rdma_ranks, channels = ranks // NVL_PEERS, sms // 2
    slots = channels * rdma_ranks * _align(recv_tokens, send_tokens)
    size = channels * rdma_ranks * (NVL_PEERS * 2 + 2) * 2 * 4
    size += slots * 2 * (hidden_bytes + SOURCE_META_BYTES + MAX_TOPK * 8 + MAX_TOPK * 4 + MAX_SCALES * 4 + 16)
    return _align(size, ALIGN)


@dataclass(frozen=True)
class DeepEpBuffer:
    """What one ``Buffer`` holds on the device: ``nvl_bytes`` by ``cudaMalloc`` (the NVLink buffer with its barrier
    signals and peer pointers, deep_ep.cpp L22-24, L49, and the workspace, L62) and ``rdma_bytes`` by NVSHMEM
    (``internode::alloc``, ``nvshmem_align``, L227; runtime.cu L70-71)."""

    num_nvl_bytes: int
    num_rdma_bytes: int

    @property
    def cuda_malloc_bytes(self) -> int:
        signals = NVL_PEERS * 4 + NVL_PEERS * 8 + NVL_PEERS * 8 if self.num_nvl_bytes else 0
        return self.num_nvl_bytes + signals + WORKSPACE_BYTES

    @property
    def total(self) -> int:
        return self.cuda_malloc_bytes + self.num_rdma_bytes


def deepep_buffer(*, ranks: int, hidden: int, element: int, sms: int) -> DeepEpBuffer:
    """Core's ``get_buffer`` (fused_a2a.py L35-68): one ``Buffer`` per process for the TP x EP group, the larger hint
    of the dispatch and combine configs, for hidden vectors of ``hidden x max(element, 2)`` bytes (L23-32)."""
    hidden_bytes = hidden * max(element, 2)
    nvl = rdma = 0
    for config in (DISPATCH_CONFIGS[ranks], COMBINE_CONFIGS[ranks]):
        _, nvl_recv, rdma_send, rdma_recv = config
        nvl = max(nvl, nvl_hint(nvl_recv, hidden_bytes, ranks, sms))
        rdma = max(rdma, rdma_hint(rdma_send, rdma_recv, hidden_bytes, ranks, sms))
    return DeepEpBuffer(nvl, rdma)


@dataclass(frozen=True)
class Received:
    """The stated tokens of one dispatch to the traced rank: ``tokens`` each source rank holds, ``per_expert`` each
    local expert receives from each source, over ``ranks`` sources and ``local_experts`` experts."""

    tokens: int
    per_expert: int
    ranks: int
    local_experts: int

    @property
    def recv_tokens(self) -> int:
        """Rows DeepEP receives (deduplicated per rank): from each source at most its tokens, at most one per pair."""
        return self.ranks * min(self.tokens, self.per_expert * self.local_experts)

    @property
    def rdma_recv_tokens(self) -> int:
        """Rows one rank's RDMA buffer receives internode: from each node, those for any of this node's ranks."""
        nodes = self.ranks // NVL_PEERS
        return nodes * min(self.tokens, self.per_expert * self.local_experts * NVL_PEERS)

    @property
    def expert_tokens(self) -> int:
        return self.per_expert * self.ranks * self.local_experts


def handle_shapes(received: Received, sms: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of DeepEP's dispatch ``handle``, which Core keeps until backward. Intranode (buffer.py L383;
    deep_ep.cpp L421-422, L473-476, and ``is_token_in_rank`` from ``get_dispatch_layout``, L268): rank and channel
    prefix matrices, the received rows' source indices, and the send map and head of the local tokens. Internode
    (buffer.py L479-482; deep_ep.cpp L794-797, L851-855): the RDMA and global prefix matrices and sums, each
    received row's source meta, and the send heads (the NVL one per row the RDMA buffer received)."""
    t, g, channels, r = received.tokens, received.ranks, sms // 2, received.recv_tokens
    i32 = torch.int32
    if g <= NVL_PEERS:
        return [((g, g), i32), ((g, channels), i32), ((g, channels), i32), ((r,), i32), ((t, g), torch.bool),
                ((t, g), i32)]
    n = g // NVL_PEERS
    return [((t, g), torch.bool), ((n, channels), i32), ((g, channels), i32), ((n, channels), i32), ((n,), i32),
            ((g, channels), i32), ((g,), i32), ((r, SOURCE_META_BYTES), torch.uint8), ((t, n), i32),
            ((received.rdma_recv_tokens, NVL_PEERS), i32)]


def handle_bytes(received: Received, sms: int) -> int:
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in handle_shapes(received, sms))


class _DispatchSaves(torch.autograd.Function):
    """DeepEP's dispatch (``Buffer.dispatch``, buffer.py L305-384): the received rows ``[R, hidden]``, their top-k
    expert indices (local, -1 elsewhere) and fp32 weights ``[R, top-k]``, and the handle's tensors, which it saves
    (Core keeps the handle on ``ctx``, fused_a2a.py L134)."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, received: Received, sms: int):
        handle = tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in handle_shapes(received, sms))
        r, topk = received.recv_tokens, token_indices.shape[1]
        recv_indices = token_indices.new_empty(r, topk)
        ctx.save_for_backward(*handle)
        ctx.mark_non_differentiable(recv_indices, *handle)
        ctx.inputs = x.new_empty(0), token_probs.new_empty(0), tuple(x.shape), tuple(token_probs.shape)
        return (x.new_empty(r, x.shape[1]), recv_indices, token_probs.new_empty(r, topk)) + handle

    @staticmethod
    def backward(ctx, grad_x, grad_indices, grad_probs, *grad_handle):
        x_like, probs_like, x_shape, probs_shape = ctx.inputs
        return x_like.new_zeros(x_shape), None, probs_like.new_zeros(probs_shape), None, None


class CombineSaves(torch.autograd.Function):
    """A flex backend's combine: the ``[tokens, hidden]`` sums back at their source; saves the handle's tensors, which
    Core keeps on ``ctx`` (DeepEP: buffer.py L387-432, fused_a2a.py L186; HybridEP's ``combine_with_unpermute``:
    hybrid_ep.cu L337-391, L361-362, fused_a2a.py L494)."""

    @staticmethod
    def forward(ctx, x, tokens: int, *handle):
        ctx.save_for_backward(*handle)
        ctx.rows = x.shape[0]
        return x.new_empty(tokens, x.shape[1])

    @staticmethod
    def backward(ctx, grad):
        return (grad.new_zeros(ctx.rows, grad.shape[1]), None) + (None,) * len(ctx.saved_tensors)


class _MultihotSaves(torch.autograd.Function):
    """Core's ``_indices_to_multihot`` (token_dispatcher.py L1328-1356) for ``pairs`` received (row, expert) pairs:
    ``probs[mask]`` keeps the ``[R, top-k]`` boolean mask, and the index put of those probabilities keeps the pairs'
    row and expert indices (two int64 ``[pairs]``)."""

    @staticmethod
    def forward(ctx, indices, probs, local_experts: int, pairs: int):
        mask = indices.new_empty(indices.shape, dtype=torch.bool)
        rows, experts = (indices.new_empty(pairs, dtype=torch.int64) for _ in range(2))
        ctx.save_for_backward(mask, rows, experts)
        ctx.shape = tuple(probs.shape)
        routing_map = indices.new_empty(indices.shape[0], local_experts, dtype=torch.bool)
        ctx.mark_non_differentiable(routing_map)
        return routing_map, probs.new_empty(indices.shape[0], local_experts, dtype=torch.float)

    @staticmethod
    def backward(ctx, grad_map, grad_probs):
        return None, grad_probs.new_zeros(ctx.shape), None, None


class _Dispatching:
    """The ``_DeepepManager`` whose ``dispatch`` or ``combine`` runs: the stand-ins read its received load."""

    manager = None


def _fused_dispatch(load: RoutedLoad, sms: int):
    def fused_dispatch(x, token_indices, token_probs, num_experts, group, async_finish=False,
                       allocate_on_comm_stream=False):
        """Core's ``fused_dispatch`` (fused_a2a.py L214-244) on the stated load."""
        ranks = group.size()
        each = load.per_expert(x.shape[0], token_indices.shape[1], num_experts)
        received = Received(x.shape[0], each, ranks, num_experts // ranks)
        load.routed_tokens.append(received.expert_tokens)
        _Dispatching.manager._received = received
        recv_x, recv_indices, recv_probs, *handle = _DispatchSaves.apply(x.contiguous(), token_indices, token_probs,
                                                                         received, sms)
        counts = _host_tensor([each * ranks] * received.local_experts)
        return recv_x, recv_indices, recv_probs, counts, tuple(handle)

    return fused_dispatch


def _fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    """Core's ``fused_combine`` (fused_a2a.py L246-258): back to the tokens the dispatch took."""
    return CombineSaves.apply(x, _Dispatching.manager._received.tokens, *handle), None


def _indices_to_multihot(self, indices, probs):
    """Core's ``_DeepepManager._indices_to_multihot`` with the received pairs of the stated load."""
    return _MultihotSaves.apply(indices, probs, self.num_local_experts, self._received.expert_tokens)


def _permuting_stated(method):
    """``get_permuted_hidden_states_by_experts`` with Core's ``permute`` told the stated count: Core reads it with
    ``tokens_per_expert.sum().item()`` (L1443), which on fake tensors is a size no one knows."""
    from megatron.core.transformer.moe import token_dispatcher as td

    def run(self, hidden_states):
        permute = td.permute

        def stated(*args, num_out_tokens=None, **kwargs):
            return permute(*args, num_out_tokens=self._received.expert_tokens, **kwargs)

        td.permute = stated
        try:
            return method(self, hidden_states)
        finally:
            td.permute = permute

    return run


def _entering(method):
    def entered(self, *args, **kwargs):
        _Dispatching.manager = self
        return method(self, *args, **kwargs)

    return entered


@contextlib.contextmanager
def deepep_kernels(load: RoutedLoad, model) -> Iterator[None]:
    """Trace ``_DeepepManager`` with the stand-ins above (see the module docstring); restores Core on exit."""
    from megatron.core.transformer.moe import token_dispatcher as td

    manager = td._DeepepManager
    saved = [(td, "fused_dispatch", td.fused_dispatch), (td, "fused_combine", td.fused_combine),
             (td, "set_deepep_num_sms", td.set_deepep_num_sms)]
    saved += [(manager, name, manager.__dict__[name])
              for name in ("dispatch", "combine", "_indices_to_multihot", "get_permuted_hidden_states_by_experts")]
    td.fused_dispatch = _fused_dispatch(load, num_sms(model))
    td.fused_combine = _fused_combine
    td.set_deepep_num_sms = lambda sms: None
    manager.dispatch, manager.combine = _entering(manager.dispatch), _entering(manager.combine)
    manager._indices_to_multihot = _indices_to_multihot
    manager.get_permuted_hidden_states_by_experts = _permuting_stated(manager.get_permuted_hidden_states_by_experts)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        _Dispatching.manager = None


def assumption(model, element: int) -> Optional[str]:
    """The flex dispatcher on DeepEP as traced, and DeepEP's buffer, which the margin must hold (it is outside
    PyTorch's allocator); None without it."""
    if not used(model):
        return None
    group, sms = ranks(model), num_sms(model)
    buffer = deepep_buffer(ranks=group, hidden=model.hidden_size, element=element, sms=sms)
    rdma = (f" + {buffer.num_rdma_bytes / GIB:.2f} GiB RDMA buffer by NVSHMEM (its symmetric heap besides)"
            if buffer.num_rdma_bytes else "")
    return (f"flex dispatcher on DeepEP: stand-ins for its fused dispatch and combine keep the handle's tensors "
            f"(DeepEP v1.2.1, {sms} SMs); a token reaches a rank once whichever of its top-k experts it holds "
            f"(estimate.features.flex); DeepEP's buffer for the TP x EP group of {group} is outside PyTorch's "
            f"allocator, so neither in this estimate nor in torch's max_memory_allocated, yet on the device: "
            f"{buffer.cuda_malloc_bytes / GIB:.2f} GiB by cudaMalloc (NVLink buffer and 32 MiB workspace){rdma}; "
            "the margin must hold it")
