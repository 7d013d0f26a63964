"""Context parallelism: a rank holds s / CP of every sequence, and attention exchanges keys and values (or heads).

Megatron Core splits each sequence into 2 x CP chunks and gives CP rank r chunks r and 2 CP - 1 - r
(``utils.py`` L2456-2510, ``_get_batch_on_this_cp_rank_per_sequence_balancing``, Bridge's data step calls it), so
every rank's layers run on s / CP tokens: the estimate traces the rank's model on ``[b, s / CP]`` token ids in a
fake world with Core's CP groups (:mod:`..fake`), and Core's RoPE picks the rank's two chunks of its frequencies
(:func:`rope_chunks_on_the_traced_device`). The distributed optimizer shards its states over DP x CP
(:func:`..static.optimizer_rule`), the expert-data-parallel group spans the CP ranks (:func:`..static.
expert_data_parallel`); the gradient buffer stays whole on every rank.

Core's attention with CP is Transformer Engine's (``dot_product_attention.py`` L56-58 refuses CP on Core's own), which
does not run here. The fused-attention stand-in (:mod:`..standins`) therefore saves for backward what TE v2.17.1's
CP kernels save (``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``), by
``cp_comm_type`` (Core's default ``p2p``, ``extensions/transformer_engine.py`` L1870-1871), for q, k, v of
``[s/CP, b, heads, d]`` on the rank:

* ``p2p`` (``AttnFuncWithCPAndKVP2P``): keys and values travel a ring in one buffer of k and v; it saves q itself
  (L1611, L1629), the last buffer received (L2117 ``kv = p2p_comm_buffers[-1]``, a new k + v allocation, L1757),
  the output it returns (bf16 steps merged in bf16, L139-150 and L2067-2069: ``to`` returns it) and the fp32
  log-sum-exp [b, heads, s/CP] (L1866, a clone), L2182-2193;
* ``all_gather`` (``AttnFuncWithCPAndKVAllGather``): q, the rank's own k and v (contiguous, L3180), the output it
  returns (L3205, L3369) and each of its two steps' fp32 log-sum-exp [b, heads, s/(2 CP)], L3430-3441;
* ``a2a`` (``AttnFuncWithCPAndQKVOA2A``, Ulysses): q, k and v exchanged to [s, b, heads/CP, d] (new tensors,
  L4045 and L528), the output before its exchange back (L4137, a tensor apart from the one returned, L4191),
  and the fp32 log-sum-exp [b, heads/CP, s, 1], L4268-4282;
* ``a2a+p2p`` (hierarchical, the P2P kernel after an all-to-all over the first of
  ``hierarchical_context_parallel_sizes``, L1533-1561 and L2067-2087): p2p's set on the exchanged q (new), with the
  output saved before its exchange back, apart from the one returned.

Each also keeps per step a random-number state and, in some formats, sequence offsets (a few bytes, not counted).
The exchange buffers live only while one layer's attention runs: :func:`exchange_transient` counts them.

A hybrid model's Mamba layers run Core's ``MambaContextParallel`` (``ssm/mamba_context_parallel.py``) as they are:
its all-to-alls hand the scan the whole sequence on heads / CP and save nothing for backward; the scan's sizes
under CP are :func:`..mamba.shapes`, and Core's assertions on them :func:`..mamba.layout_checks`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_bridge_ext.findings import ERROR, Finding

P2P, ALL_GATHER, A2A, A2A_P2P = "p2p", "all_gather", "a2a", "a2a+p2p"
COMM_TYPES = (P2P, ALL_GATHER, A2A, A2A_P2P)
DEFAULT = P2P
"""What Core asks of TE when ``cp_comm_type`` is None (``extensions/transformer_engine.py`` L1870-1871)."""


def used(model) -> bool:
    return (getattr(model, "context_parallel_size", 1) or 1) > 1


def comm_type(value: Optional[str]) -> str:
    """TE's name for a layer's ``cp_comm_type`` (None: p2p; ``allgather`` spelled either way)."""
    if value is None:
        return DEFAULT
    return ALL_GATHER if value.replace("_", "").lower() == "allgather" else value


def comm_types(model) -> list[str]:
    """The ``cp_comm_type`` of every layer (a list gives one per layer, Core's ``transformer_layer.py`` L361-368)."""
    value = getattr(model, "cp_comm_type", None)
    values = value if isinstance(value, list) else [value] * model.num_layers
    return [comm_type(v) for v in values]


def a2a_size(model) -> int:
    """The ranks of the all-to-all of ``a2a+p2p``: the first of ``hierarchical_context_parallel_sizes``."""
    sizes = getattr(model, "hierarchical_context_parallel_sizes", None)
    return sizes[0] if sizes else 1


def findings(model) -> list[Finding]:
    """The context-parallel variants the estimate does not model, one finding each."""
    if not used(model):
        return []
    out = []
    unknown = sorted(set(comm_types(model)) - set(COMM_TYPES))
    if unknown:
        out.append(_not_modelled("model.cp_comm_type", f"cp_comm_type {', '.join(unknown)} is not one of Transformer "
                                 f"Engine's {', '.join(COMM_TYPES)}", f"use one of {', '.join(COMM_TYPES)}"))
    return out


def layout_findings(model) -> list[Finding]:
    """What Core's data split and TE's CP kernels refuse about the layout: a sequence of 2 x CP equal chunks (and
    each of a rank's chunks split in two by the causal kernels, TE L1626-1629), heads each all-to-all divides."""
    if not used(model):
        return []
    cp, tp = model.context_parallel_size, model.tensor_model_parallel_size
    out = []
    if model.seq_length % (2 * cp):
        out.append(Finding("parallel_layout", ERROR, "model.seq_length",
                           f"sequence {model.seq_length} is not divisible by 2 x CP = {2 * cp} (Megatron Core splits "
                           "it into 2 x CP chunks, utils.py L2461-2467)", "choose a sequence that divides"))
    types = set(comm_types(model))
    sizes = [size for kind, size in ((A2A, cp), (A2A_P2P, a2a_size(model))) if kind in types]
    heads = model.num_attention_heads // tp
    groups = (model.num_query_groups or model.num_attention_heads) // tp
    for size in sizes:
        if heads % size or groups % size:
            out.append(Finding("parallel_layout", ERROR, "model.cp_comm_type",
                               f"the all-to-all over {size} CP ranks splits the {heads} heads and {groups} query "
                               f"groups of a TP rank, which {size} does not divide (TE context_parallel.py L3952-3953)",
                               "choose sizes that divide, or cp_comm_type=p2p"))
    return out


def trace_findings(model, *, attention: str, fused: str) -> list[Finding]:
    """Core's local attention refuses CP (``dot_product_attention.py`` L56-58): only the fused stand-in traces it."""
    if not used(model) or attention == fused:
        return []
    return [_not_modelled("attention", "unfused attention is not modelled with context parallelism: Core's local "
                          "DotProductAttention refuses it (dot_product_attention.py L56-58)",
                          "estimate with the fused attention (the default)")]


def _not_modelled(setting: str, message: str, fix: str) -> Finding:
    return Finding("unsupported_model", ERROR, setting, message, fix)


@dataclass(frozen=True)
class Kernel:
    """The CP kernel of one layer's core attention: its ``cp_comm_type``, the CP size and the all-to-all's ranks
    (CP for ``a2a``, the first hierarchical size for ``a2a+p2p``, 1 otherwise)."""

    comm: str
    cp: int
    a2a: int = 1

    @classmethod
    def of(cls, config, cp_comm_type: Optional[str]) -> Optional["Kernel"]:
        """The kernel Core's ``TEDotProductAttention`` would ask TE for (L1866-1882), None without CP."""
        if not used(config):
            return None
        comm = comm_type(cp_comm_type)
        a2a = {A2A: config.context_parallel_size, A2A_P2P: a2a_size(config)}.get(comm, 1)
        return cls(comm, config.context_parallel_size, a2a)


class _ContextParallelSaves(torch.autograd.Function):
    """Causal attention with CP that saves what TE's kernel for ``kernel.comm`` saves (module docstring); returns the
    output [sq, b, heads x v width]."""

    @staticmethod
    def forward(ctx, query, key, value, kernel: Kernel):
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(query, FakeTensor):
            raise RuntimeError("the context-parallel attention stand-in models a kernel's saved tensors on fake "
                               "tensors only; it computes no attention")
        sq, b, heads, _ = query.shape
        out = query.new_empty(sq, b, heads * value.shape[-1])
        lse = torch.empty(b, heads, sq, dtype=torch.float32, device=query.device)
        if kernel.comm == ALL_GATHER:
            halves = [torch.empty(b, heads, sq // 2, dtype=torch.float32, device=query.device) for _ in range(2)]
            saved = (query, key, value.contiguous(), out, *halves)
        elif kernel.comm == P2P:
            saved = (query, _kv_buffer(key, value), out, lse)
        elif kernel.comm == A2A:
            saved = (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), torch.empty_like(out),
                     lse)
            out = torch.empty_like(out)  # the exchange back makes the returned output
        else:  # A2A_P2P
            saved = (torch.empty_like(query), _kv_buffer(key, value), torch.empty_like(out), lse)
            out = torch.empty_like(out)
        ctx.save_for_backward(*saved)
        ctx.shapes = query.shape, key.shape, value.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.shapes
        return grad_out.new_empty(q), grad_out.new_empty(k), grad_out.new_empty(v), None


def _kv_buffer(key, value) -> torch.Tensor:
    """The ring's buffer of k and v flattened one after the other (TE L1741, L1757)."""
    return key.new_empty(key.numel() + value.numel())


def attention(query, key, value, kernel: Kernel) -> torch.Tensor:
    """Core attention with CP as the stand-in traces it (:class:`_ContextParallelSaves`)."""
    return _ContextParallelSaves.apply(query, key, value, kernel)


@dataclass(frozen=True)
class Shapes:
    """One layer's core attention on a CP rank: tokens s / CP, micro-batch, heads, query groups and head widths of
    a TP rank (keys of ``qk_width`` per head, values of ``v_width``), element bytes."""

    seq: int
    micro_batch: int
    heads: int
    groups: int
    qk_width: int
    v_width: int
    element: int

    @property
    def q(self) -> int:
        return self.seq * self.micro_batch * self.heads * self.qk_width * self.element

    @property
    def kv(self) -> int:
        return self.seq * self.micro_batch * self.groups * (self.qk_width + self.v_width) * self.element

    @property
    def out(self) -> int:
        return self.seq * self.micro_batch * self.heads * self.v_width * self.element

    @property
    def lse(self) -> int:
        return self.seq * self.micro_batch * self.heads * 4


def exchange_bytes(kernel: Kernel, shapes: Shapes) -> tuple[int, str]:
    """The bytes one layer's CP exchange allocates beyond what it saves, at its larger of forward and backward,
    and their sources (TE v2.17.1 context_parallel.py)."""
    q, kv, out, lse = shapes.q, shapes.kv, shapes.out, shapes.lse
    if kernel.comm == ALL_GATHER:
        return 3 * kernel.cp * kv, (f"backward: the gathered k and v of {kernel.cp} ranks, their reordered copies and "
                                    "their full-sequence gradients, 3 x CP x (k + v) (L3575-3603)")
    if kernel.comm == A2A:
        return q + kv + out, "the all-to-all's contiguous send copies of q, k, v and of the output (L524)"
    ring = kernel.cp // kernel.a2a
    forward = (ring - 1) * kv + ring * (out + lse)
    backward = q + 4 * kv
    send = q + kv + out if kernel.comm == A2A_P2P else 0
    return max(forward, backward) + send, (
        f"the ring of {ring}: forward {ring - 1} more k + v buffers and {ring} steps' outputs and fp32 log-sum-exp "
        f"(L1723-1724, L1757), backward a dq buffer and two [2, k + v] buffers (L2446-2449); the larger"
        + (", + the all-to-all's send copies of q, k, v and the output (L524)" if send else ""))


def shapes(model, *, local_seq: int, micro_batch: int, element: int) -> Shapes:
    """A TP rank's core attention of ``model`` on ``local_seq`` tokens (multi-latent attention: its key and value
    widths, one key-value head per query head)."""
    tp = model.tensor_model_parallel_size
    heads = model.num_attention_heads // tp
    if getattr(model, "multi_latent_attention", False):
        return Shapes(local_seq, micro_batch, heads, heads, model.qk_head_dim + model.qk_pos_emb_head_dim,
                      model.v_head_dim, element)
    groups = (model.num_query_groups or model.num_attention_heads) // tp
    return Shapes(local_seq, micro_batch, heads, groups, model.kv_channels, model.kv_channels, element)


def transient(model, *, local_seq: int, micro_batch: int, element: int) -> Optional[tuple[int, str]]:
    """The largest CP exchange of the model's layers (one layer's attention runs at a time) and its basis; None
    without CP."""
    if not used(model):
        return None
    size = shapes(model, local_seq=local_seq, micro_batch=micro_batch, element=element)
    kernels = {comm: Kernel.of(model, comm) for comm in comm_types(model)}
    nbytes, basis = max(exchange_bytes(kernel, size) for kernel in kernels.values())
    return nbytes, f"formula: context-parallel attention's exchange buffers (Transformer Engine): {basis}"


@contextlib.contextmanager
def rope_chunks_on_the_traced_device() -> Iterator[None]:
    """Core's ``get_pos_emb_on_this_cp_rank`` (``rope_utils.py`` L48-70) picks the rank's two of 2 x CP chunks of
    the rotary frequencies with an index it builds in pinned host memory and copies to CUDA, which needs a driver;
    while tracing the index is made on the frequencies' own device, the same selection otherwise. Core's names are
    put back on exit."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def on_this_rank(pos_emb, seq_dim, cp_group):
        cp, rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
        chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
        chunks = chunks.index_select(seq_dim, index)
        return chunks.view(*chunks.shape[:seq_dim], -1, *chunks.shape[seq_dim + 2:])

    modules = (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding)
    saved = [(module, module.get_pos_emb_on_this_cp_rank) for module in modules]
    for module in modules:
        module.get_pos_emb_on_this_cp_rank = on_this_rank
    try:
        yield
    finally:
        for module, value in saved:
            module.get_pos_emb_on_this_cp_rank = value


def assumption(model) -> Optional[str]:
    """How the estimate traced context parallelism, or None without it."""
    if not used(model):
        return None
    kinds = ", ".join(dict.fromkeys(comm_types(model)))
    return (f"context parallelism: CP={model.context_parallel_size}, each rank traced on s / CP tokens (Core's 2 x CP "
            f"chunks); core attention saves what Transformer Engine's {kinds} CP kernel saves, and its exchange "
            "buffers are a transient (estimate.features.context_parallel)")
