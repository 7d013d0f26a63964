"""What captured CUDA graphs add to a rank's memory once they exist: the static buffers the captured layers keep.

Both implementations capture every graph into one pool in the order the schedule runs them (Core's
``transformer/cuda_graphs.py``: ``CudaGraphManager.global_mempool``, L1837-1838, graphs created in recorded order,
L541-620; Transformer Engine's ``make_graphed_callables`` with the schedule's ``_order``, one ``mempool``), so a replay
puts a captured layer's intermediates where the eager step put them: the activations already counted. A buffer
that is weak-referenced after its last capture (a tensor that points at pool memory without holding it) is such an
intermediate too: later captures reuse its bytes. What comes on top is what stays strongly held, or what the pool's
layout holds that the eager step does not.

``transformer_engine`` (Bridge captures after ``cuda_graph_warmup_steps``, ``training/train.py`` L429-441, through
Core's ``TECudaGraphHelper``; Transformer Engine >= 2.7 reuses buffers, ``_reuse_graph_input_output_buffers``,
cuda_graphs.py L2592-2595; TE read at tag v2.18, commit 27486e03cfc1fa41f6932dcecdc47c71c47eac3e,
``transformer_engine/pytorch/graph.py``), held after the capture:

* the static inputs Core builds for each (layer, microbatch) sample (``_get_layer_static_inputs``, cuda_graphs.py
  L2296-2351): the hidden states [s, b, h] in bf16 whatever the model's dtype (``GraphableMegatronModule
  .get_layer_static_inputs``, module.py L247-262; s the sequence shard: / CP, / TP under SP) and, for a callable
  with self-attention, a causal mask [b, 1, s / CP, s] of bools (transformer_layer.py L1111-1121). A sample whose
  backward has run hands its inputs to the next forward with the same signature (Core, cuda_graphs.py L2360-2470;
  TE the same, graph.py L255-324), so each signature holds as many sets as the schedule's order (Core's
  ``get_schedule_table`` and ``convert_schedule_table_to_order``, cuda_graphs.py L2493-2530, L2800-2823; one
  microbatch without pipeline parallelism, L2505-2511) has its samples between forward and backward at most;
* the rotary table, one for all samples (``rotary_pos_emb_cache``, cuda_graphs.py L2306-2320): [s / CP, 1, 1, d]
  fp32, d the rotary dimension (rotary_pos_embedding.py L150-206), when a captured callable has attention and the
  model RoPE (not MLA);
* one set of output gradients per signature of the outputs that require grad (``static_grad_outputs_dict``,
  graph.py L664-683, allocated outside the pool): the hidden states; a MoE layer captured to its router
  (``moe_router``) returns the pre-MLP norm's output, the router's probabilities [s x b, experts] (the router's
  dtype), the residual and the shared experts' output (transformer_layer.py L938-955, moe_utils.py L1485-1488);
  its routing map needs no gradient;
* the input gradient of the last captured backward (graph.py L715-747 weak-reference the static outputs after
  their backward and every other input gradient): one [s, b, h] bf16.

``local`` (Core's ``CudaGraphManager``): every buffer a runner allocates in the pool is marked
``is_from_global_mempool`` (``alloc_tensor_from_graph_mempool``, L279-290; outputs L1341-1351, input gradients
L1522-1527) and weak-referenced after its backward graph (L1367, L1544-1547; ``make_weakref`` L395-425, through
Transformer Engine's ``make_weak_ref``: without Transformer Engine nothing is, L578-585, and this count is low). A
runner's input that is another graph's output is that buffer (``_resolve_input_buffer``, L1209-1243), an output
gradient the next graph's input gradient (L1405-1420); an input from eager code is cloned into the pool
(``clone_inputs=True``, L615, L1231-1251) and, saved for backward, kept until the backward capture. So the pool
holds, beyond the eager step, one clone [s, b, h] per runner whose input comes from eager code (the first captured
layer of a chunk or one after a layer that runs eagerly; with the MoE router scopes the router graph's input and
the post-process graph's expert output, ``transition_cudagraph_scope``, transformer_layer.py L1580-1586,
L1647-1721) per microbatch in flight: one runner per layer reused by every microbatch without pipeline parallelism,
one per microbatch of the recorded step with it (``get_cudagraph_runner``, L1867-1932). Upper bound: on the first
chunk of the first stage, whose eager input (the embedding's output) is freed after the copy; and under a partial
scope (``attn``, ``mlp``), counted as a clone per captured layer even where two captured parts hand over directly.

``full_iteration``: one graph for the forward and backward; its inputs are the step's batch, nothing per layer.

Left out: the parameter-gradient slots of the last captured backward (dummies under gradient-accumulation fusion);
``moe_preprocess`` counted at ``moe_router``'s shapes (the permuted tokens' shape depends on the dispatcher); the
input sets of the multi-token-prediction layers Core's TE helper captures too (cuda_graphs.py L2174-2179: only the
decoder's layers are counted); with ``overlap_moe_expert_parallel_comm`` Core captures every microbatch and orders
the layers apart (L2504-2511, L2537-2548), counted here as without it; the local rotary table's clone. The pool's
reserved but free memory is outside the allocated figures the phases give.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from types import SimpleNamespace
from typing import Optional

from megatron_bridge_ext.estimate.report import BUFFERS, Component

STATIC_BUFFERS = "CUDA-graph static inputs, outputs and gradients"
BF16 = 2
"""Core builds the static hidden states in bf16 whatever the model's dtype (module.py L257-262)."""


def impl_of(model) -> str:
    """``cuda_graph_impl``, the deprecated ``enable_cuda_graph`` / ``external_cuda_graph`` read as Core's
    ``TransformerConfig.__post_init__`` reads them."""
    impl = getattr(model, "cuda_graph_impl", None) or "none"
    if impl == "none" and getattr(model, "enable_cuda_graph", False):
        return "local"
    if impl == "none" and getattr(model, "external_cuda_graph", False):
        return "transformer_engine"
    return impl


HYBRID_SCOPES = {"M": ("mamba",), "*": ("attn",), "D": ("attn",), "+": ("attn",), "G": ("attn",), "-": ("mlp",),
                 "E": ("moe", "moe_router", "moe_preprocess")}
"""Which ``cuda_graph_modules`` capture a hybrid layer of each pattern symbol (``_layer_is_graphable``,
cuda_graphs.py L2043-2083: Mamba layers by ``mamba``, layers with attention by ``attn``, MoE layers by ``moe``,
``moe_router`` or ``moe_preprocess``, dense MLP layers by ``mlp``; a gated delta net counted with attention)."""

MOE_SCOPES = {"moe", "moe_router", "moe_preprocess"}
ROUTER_SCOPES = {"moe_router", "moe_preprocess"}


@dataclass(frozen=True)
class Graphed:
    """What one layer's captured callable covers: ``attention`` (its static inputs carry the causal mask and the
    rotary table), ``router`` (a MoE layer captured to its router: more outputs, two local runners), ``whole`` (the
    whole layer: its output is the next captured layer's input)."""

    attention: bool
    router: bool
    whole: bool


def _scopes(model) -> set:
    from megatron.core.transformer.cuda_graph_config import normalize_cuda_graph_modules

    modules = getattr(model, "cuda_graph_modules", None)
    return {s.name for s in normalize_cuda_graph_modules(modules)[0]} if modules else set()


def graphed(kind, scopes: set) -> Optional[Graphed]:
    """The captured callable of a layer of ``kind`` (:func:`..build.stage_layer_kinds`) under ``scopes``, None when
    it runs eagerly: every layer with ``cuda_graph_modules`` empty or ``full``, else those ``_layer_is_graphable``
    (cuda_graphs.py L2043-2083) admits. A GPT layer always has attention; its MLP is MoE or dense by its kind."""
    from megatron_bridge_ext.estimate.build import is_moe_kind

    if isinstance(kind, str):
        own = set(HYBRID_SCOPES.get(kind, ()))
        attention, moe = "attn" in own, kind == "E"
    else:
        attention, moe = True, is_moe_kind(kind)
        own = {"attn"} | (MOE_SCOPES if moe else {"mlp"})
    if not scopes:
        return Graphed(attention=attention, router=False, whole=True)
    if not scopes & own:
        return None
    return Graphed(attention=attention and "attn" in scopes, router=moe and bool(scopes & ROUTER_SCOPES),
                   whole=scopes >= own - ROUTER_SCOPES and not (moe and scopes & ROUTER_SCOPES))


@dataclass(frozen=True)
class Shapes:
    """``tokens``: the sequence shard between layers (s / CP, / TP under SP); ``seq``: the whole sequence;
    ``element``: the activations' bytes per element."""

    tokens: int
    micro_batch: int
    hidden: int
    element: int
    seq: int
    cp: int = 1

    def hidden_states(self, size: int) -> int:
        return self.tokens * self.micro_batch * self.hidden * size

    def mask(self) -> int:
        return self.micro_batch * (self.seq // self.cp) * self.seq


@dataclass(frozen=True)
class Schedule:
    """The stage's place in the pipeline: ``chunk_forwards`` the forwards each model chunk holds at once
    (:func:`..pipeline.chunk_forwards`)."""

    pp: int
    vpp: int
    stage: int
    num_microbatches: int
    group: int
    chunk_forwards: tuple


def schedule_order(schedule: Schedule) -> list[int]:
    """The forward (chunk + 1) and backward (-(chunk + 1)) order Core hands TE's capture (cuda_graphs.py
    L2493-2530): Core's own schedule table and warmup count, one microbatch without pipeline parallelism."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    microbatches = 1 if schedule.pp == 1 else schedule.num_microbatches
    group = SimpleNamespace(size=lambda: schedule.pp, rank=lambda: schedule.stage)
    p2p = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=schedule.vpp if schedule.vpp > 1
                          else None)
    _, _, warmup, _ = get_pp_rank_microbatches(microbatches, schedule.vpp, schedule.group, p2p_communicator=p2p)
    return convert_schedule_table_to_order(warmup, schedule.vpp,
                                           get_schedule_table(microbatches, schedule.vpp, schedule.group))


def reused_sets(order: list[int], per_chunk: list[int]) -> int:
    """The static input sets of one signature the order allocates, ``per_chunk`` its samples in each chunk's
    forward: a forward takes a consumed set if one is free, a backward frees its chunk's oldest forward's
    (cuda_graphs.py L2389-2466), so the sets are the most samples between forward and backward at once."""
    pending, now, peak = [0] * len(per_chunk), 0, 0
    for step in order:
        chunk = abs(ceil(step)) - 1
        if step > 0:
            pending[chunk] += 1
            now += per_chunk[chunk]
            peak = max(peak, now)
        elif ceil(step) == step and pending[chunk]:
            pending[chunk] -= 1
            now -= per_chunk[chunk]
    return peak


@dataclass(frozen=True)
class Model:
    """The model's fields the buffers' shapes read."""

    experts: int = 0
    router_element: int = 2
    shared_experts: bool = False
    rotary_dim: int = 0


def model_of(provider, element: int) -> Model:
    """:class:`Model` from a provider: the router's dtype (``moe_router_dtype``, router.py L103-108), the rotary
    dimension (``kv_channels x rotary_percent``, rotary_pos_embedding.py L72-74) for RoPE without MLA."""
    rope = getattr(provider, "position_embedding_type", None) == "rope" and \
        not getattr(provider, "multi_latent_attention", False)
    kv = getattr(provider, "kv_channels", None) or provider.hidden_size // provider.num_attention_heads
    router = {"fp32": 4, "fp64": 8}.get(getattr(provider, "moe_router_dtype", None), element)
    return Model(experts=getattr(provider, "num_moe_experts", None) or 0, router_element=router,
                 shared_experts=bool(getattr(provider, "moe_shared_expert_intermediate_size", None)),
                 rotary_dim=int(kv * getattr(provider, "rotary_percent", 1.0)) if rope else 0)


def te_parts(layers: list, schedule: Schedule, shapes: Shapes, model: Model) -> list[tuple[str, int]]:
    """The bytes Transformer Engine's graphs hold, by part (module docstring); ``layers``: (chunk, :class:`Graphed`)
    of each captured layer."""
    order = schedule_order(schedule)
    parts = []
    for attention in (True, False):
        per_chunk = [sum(1 for c, g in layers if c == chunk and g.attention == attention)
                     for chunk in range(schedule.vpp)]
        if any(per_chunk):
            sets = reused_sets(order, per_chunk)
            one = shapes.hidden_states(BF16) + (shapes.mask() if attention else 0)
            parts.append((f"{sets} static input set(s)" + (" with the mask" if attention else ""), sets * one))
    if model.rotary_dim and any(g.attention for _, g in layers):
        parts.append(("rotary table", shapes.seq // shapes.cp * model.rotary_dim * 4))
    hidden = shapes.hidden_states(shapes.element)
    if any(not g.router for _, g in layers):
        parts.append(("output gradient", hidden))
    if any(g.router for _, g in layers):
        probs = shapes.tokens * shapes.micro_batch * model.experts * model.router_element
        parts.append(("router's output gradients", (3 if model.shared_experts else 2) * hidden + probs))
    parts.append(("last input gradient", shapes.hidden_states(BF16)))
    return parts


def local_parts(layers: list, schedule: Schedule, shapes: Shapes) -> list[tuple[str, int]]:
    """The clones of eager inputs Core's local runners keep in the pool per microbatch in flight (module
    docstring); ``layers``: (chunk, :class:`Graphed` or None) of each of the stage's layers. A whole layer or an
    attention part takes the layer's input, a graph's output where the previous layer of the chunk ends in one (a
    whole layer, or the router scope's post-process graph)."""
    clones, handed = 0, None
    for chunk, g in layers:
        if g is not None:
            heads = 2 if g.router else int(not ((g.whole or g.attention) and handed == chunk))
            clones += heads * (1 if schedule.pp == 1 else schedule.chunk_forwards[chunk])
        handed = chunk if g is not None and (g.whole or g.router) else None
    return [(f"{clones} cloned input(s)", clones * shapes.hidden_states(shapes.element))] if clones else []


def static_buffers(provider, *, impl: str, shapes: Shapes, kinds: list, layer_chunks: tuple,
                   schedule: Schedule) -> Optional[Component]:
    """The static buffers of the stage's captured graphs, None without per-layer graphs. ``kinds``: the stage's
    layer kinds in chunk order, ``layer_chunks`` the chunk of each (all 0 when their lengths differ)."""
    if impl not in ("transformer_engine", "local"):
        return None
    scopes = _scopes(provider)
    chunks = layer_chunks if len(layer_chunks) == len(kinds) else (0,) * len(kinds)
    layers = [(chunk, graphed(kind, scopes)) for chunk, kind in zip(chunks, kinds)]
    captured = [(chunk, g) for chunk, g in layers if g is not None]
    if not captured:
        return None
    parts = te_parts(captured, schedule, shapes, model_of(provider, shapes.element)) \
        if impl == "transformer_engine" else local_parts(layers, schedule, shapes)
    exact = "formula" if impl == "transformer_engine" else \
        "formula (an upper bound on stage 0's first chunk and under partial scopes)"
    return Component(BUFFERS, STATIC_BUFFERS, sum(b for _, b in parts),
                     f"{exact}: {len(captured)} captured layer(s) of {len(kinds)} ({impl}): "
                     + ", ".join(f"{name} {b}" for name, b in parts) + " B (estimate.cuda_graphs)")
