"""A stated expert load in place of the router's data-dependent choice, so that an MoE layer traces on fake tensors.

Megatron Core's router picks each token's top-k experts from its logits, and the token dispatchers
read how many tokens each expert got (``tokens_per_expert``, the all-to-all split sizes) back to the
host to size their buffers. On fake tensors there are no logits to read. Inside :func:`balanced_routing`
the router, the permutation and every saved tensor stay Core's; only the counts the dispatchers read
are stated instead: every expert of the traced rank receives ``ceil(load x tokens x top-k / experts)``
tokens from each rank that sends it tokens, where ``load`` is the imbalance factor (1.0: the balanced
load; above 1: the traced rank's experts are the most loaded ones, each ``load`` times the balanced
share, an upper bound for that rank). With token dropping (``moe_expert_capacity_factor``) each expert's tokens from
one rank are capped at Core's capacity, or padded to it (:meth:`RoutedLoad.received`, :mod:`.features.token_dropping`);
the all-to-all dispatcher padded to capacity runs Core's own static ``preprocess``. What the stand-ins replace, in
``megatron/core/transformer/moe/token_dispatcher.py`` (Core 0.19):

* ``MoEAllGatherTokenDispatcher.dispatch_postprocess``: the counts and the probability
  ``masked_select``, whose output size is data-dependent (a stand-in that saves what
  ``masked_select`` saves: its input and the mask); the slices and ``permute`` are Core's;
* ``MoEAlltoAllTokenDispatcher.preprocess``: the split sizes, computed from the stated load as
  Core's device-to-host copy would leave them (host tensors); ``_maybe_dtoh_and_synchronize``: no
  side stream to copy on (the counts are already on the host); the stream its constructor makes
  is a placeholder (no CUDA needed);
* ``sort_chunks_by_idxs`` (``moe_utils.py``) as the all-to-all dispatcher calls it: with equal
  chunks it is a reordering that saves nothing, done here without reading the chunk sizes.

:func:`in_order_streams`, on a host without CUDA only: shared experts overlapped with the dispatch
(``moe_shared_expert_overlap``, ``transformer/moe/shared_experts.py``) make a side stream when built and
run their layers on it while the dispatcher runs; their saves differ from the shared experts run in order
(the dispatcher does their communication). ``torch.cuda.Stream``, ``current_stream`` and ``stream`` are
then in-order stand-ins, so that the overlapped path itself is traced, in program order.

It models the load for tracing on fake tensors only: no numerics, and nothing of it is used in training.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy
import torch

BALANCED = 1.0


@dataclass
class RoutedLoad:
    """The stated load, and the tokens each traced MoE layer's local experts received (for the transients)."""

    imbalance: float = BALANCED
    routed_tokens: list[int] = field(default_factory=list)
    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = False

    def per_expert(self, source_tokens: int, topk: int, experts: int) -> int:
        """Tokens one expert receives from ``source_tokens`` tokens routed top-``topk`` over ``experts``."""
        return math.ceil(self.imbalance * source_tokens * topk / experts)

    def received(self, tokens: int, topk: int, experts: int, *, sources: int = 1) -> int:
        """Tokens one expert receives from ``sources`` ranks whose routers each hold ``tokens`` tokens: the stated
        share, or with a capacity factor what Core's ``apply_router_token_dropping`` (``moe_utils.py`` L958-1021)
        leaves of it from each rank: at most the capacity (``get_capacity`` of tokens x top-k over the experts,
        L241-259), and with ``pad_to_capacity`` exactly the capacity (every token where the capacity exceeds the
        tokens, L997-999, L1013-1015)."""
        share = self.per_expert(tokens * sources, topk, experts)
        if self.capacity_factor is None:
            return share
        from megatron.core.transformer.moe.moe_utils import get_capacity

        capacity = get_capacity(tokens * topk, experts, self.capacity_factor)
        if self.pad_to_capacity:
            return sources * min(capacity, tokens)
        return min(share, sources * capacity)

    def sent(self, tokens: int, topk: int, experts: int) -> int:
        """Tokens a rank's router sends: each token to its top-k experts, with a capacity factor at most the
        capacity to each expert."""
        if self.capacity_factor is None:
            return tokens * topk
        from megatron.core.transformer.moe.moe_utils import get_capacity

        return min(tokens * topk, experts * get_capacity(tokens * topk, experts, self.capacity_factor))


class _MaskedSelectSaves(torch.autograd.Function):
    """``source.masked_select(mask)`` with a stated output size: saves what torch's keeps (source and mask)."""

    @staticmethod
    def forward(ctx, source, mask, size: int):
        ctx.save_for_backward(source, mask)
        return source.new_empty(size)

    @staticmethod
    def backward(ctx, grad):
        source, _ = ctx.saved_tensors
        return torch.zeros_like(source), None, None


def _host_tensor(values) -> torch.Tensor:
    """A real host tensor of counts, made outside the fake mode (Core reads it with ``tolist``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.tensor(values, dtype=torch.long)


def _allgather_dispatch_postprocess(load: RoutedLoad):
    from megatron.core.transformer.moe import token_dispatcher

    def dispatch_postprocess(self, hidden_states, probs):
        """Core's ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` with the stated counts."""
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        self.local_probs = probs[:, first:last].contiguous()
        sources = self.tp_size * self.ep_size  # the ranks whose tokens the dispatch gathered
        each = load.received(self.local_map.shape[0] // sources, self.router_topk, self.config.num_moe_experts,
                             sources=sources)
        total = each * self.num_local_experts
        load.routed_tokens.append(total)
        permuted, _, self.reversed_local_input_permutation_mapping, _, _ = token_dispatcher.permute(
            hidden_states, self.local_map, num_out_tokens=total, fused=self.config.moe_permute_fusion)
        self.local_probs = _MaskedSelectSaves.apply(self.local_probs.T.contiguous(), self.local_map.T.contiguous(),
                                                    total)
        self.routing_map = None
        return permuted, _host_tensor([each] * self.num_local_experts), self.local_probs

    return dispatch_postprocess


def _alltoall_preprocess(load: RoutedLoad, core_preprocess):
    def preprocess(self, routing_map):
        """Core's ``MoEAlltoAllTokenDispatcher.preprocess`` with the stated counts, as its host copies leave them
        (numpy split sizes, host tensors of counts); padded to capacity, Core's own (its counts are the capacity,
        L511-531), with the counts handed back on the host."""
        if self.drop_and_pad:
            core_preprocess(self, routing_map)
            each = self.capacity * self.tp_size * self.ep_size
            load.routed_tokens.append(each * self.num_local_experts)
            return _host_tensor([each] * self.num_local_experts)
        tokens, topk = routing_map.size(0), self.config.moe_router_topk
        each = load.received(tokens, topk, self.num_experts)  # from one source rank to one local expert
        self.num_out_tokens = load.sent(tokens, topk, self.num_experts)
        sources = self.tp_size * self.ep_size
        load.routed_tokens.append(each * sources * self.num_local_experts)
        sent = [self.num_out_tokens // self.ep_size + (r < self.num_out_tokens % self.ep_size)
                for r in range(self.ep_size)]
        self.input_splits = numpy.array(sent)
        self.output_splits = numpy.array([each * self.num_local_experts] * self.ep_size)
        self.output_splits_tp = numpy.array([each * self.num_local_experts * self.ep_size] * self.tp_size)
        self.num_global_tokens_per_local_expert = _host_tensor([[each] * self.num_local_experts] * sources)
        return _host_tensor([each * sources] * self.num_local_experts)

    return preprocess


def _counts_on_host(self, point, tokens_per_expert=None):
    """The counts are host tensors already: nothing to copy, no stream to wait for."""
    return tokens_per_expert


def _sort_equal_chunks(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """``sort_chunks_by_idxs`` for equal chunks: a new tensor of the input's shape, saving nothing for backward, as
    Core's split and cat do (their order does not change a shape or a saved byte, so a copy stands in for them)."""
    return input.clone(), (probs.clone() if probs is not None else None)


class _NoStream:
    """Stands in for the CUDA stream ``MoEAlltoAllTokenDispatcher`` makes once for its host copies."""


class InOrderStream:
    """A CUDA stream or event where there is none: work runs in program order, which every wait already implies.

    The estimate's trace uses it (:func:`in_order_streams`), and so do the CPU test ranks
    (``megatron_bridge_ext.testing.cpu_emulation``), for ``torch.cuda.Stream`` and ``Event`` alike."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs) -> "InOrderStream":
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def in_order_streams() -> Iterator[None]:
    """Trace Core's side-stream paths (overlapped shared experts) without CUDA (see the module docstring); a host
    with CUDA keeps its own streams. Restores torch and Core's cached stream on exit."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    current = InOrderStream()
    saved = [(torch.cuda, name, getattr(torch.cuda, name)) for name in ("Stream", "current_stream", "stream")]
    saved.append((SharedExpertMLP, "stream", SharedExpertMLP.stream))
    torch.cuda.Stream = InOrderStream
    torch.cuda.current_stream = lambda device=None: current
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    SharedExpertMLP.stream = None
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@contextlib.contextmanager
def balanced_routing(load: RoutedLoad) -> Iterator[RoutedLoad]:
    """Build and trace MoE layers with the stated ``load`` (see the module docstring); restores Core on exit."""
    from megatron.core.transformer.moe import token_dispatcher as td

    allgather, alltoall = td.MoEAllGatherTokenDispatcher, td.MoEAlltoAllTokenDispatcher
    saved = [(allgather, "dispatch_postprocess", allgather.__dict__["dispatch_postprocess"]),
             (alltoall, "preprocess", alltoall.__dict__["preprocess"]),
             (alltoall, "_maybe_dtoh_and_synchronize", alltoall.__dict__["_maybe_dtoh_and_synchronize"]),
             (alltoall, "cuda_dtoh_stream", alltoall.__dict__["cuda_dtoh_stream"]),
             (td, "sort_chunks_by_idxs", td.sort_chunks_by_idxs)]
    allgather.dispatch_postprocess = _allgather_dispatch_postprocess(load)
    alltoall.preprocess = _alltoall_preprocess(load, alltoall.__dict__["preprocess"])
    alltoall._maybe_dtoh_and_synchronize = _counts_on_host
    alltoall.cuda_dtoh_stream = alltoall.cuda_dtoh_stream or _NoStream()
    td.sort_chunks_by_idxs = _sort_equal_chunks
    try:
        yield load
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
