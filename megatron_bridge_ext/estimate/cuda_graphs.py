"""What captured CUDA graphs add to a rank's memory once they exist: the static buffers of each captured region.

The graphs' private pool holds, besides those buffers, the intermediates of every captured region: what its layers
save for backward (the traced activations) and their transients. Both implementations capture every graph into one
pool in the order they run (Core's ``transformer/cuda_graphs.py``: ``CudaGraphManager.global_mempool``, L1837-1838,
graphs created in recorded order, L541-620; Transformer Engine's ``make_graphed_callables`` with the schedule's
``_order``, ``transformer_engine/pytorch/graph.py`` L676-680, L693-729, one ``mempool``, L485), so a replay allocates
those intermediates where the eager step did: the same bytes as the activations already counted. What comes on top
are the buffers that stay between replays, each [s, b, h] (the sequence shard under SP), for each layer with a graph
(:func:`captured_layers`):

* ``transformer_engine`` (Bridge captures it after ``cuda_graph_warmup_steps``, ``training/train.py`` L429-441, through
  Core's ``TECudaGraphHelper``): a static input per (layer, microbatch) that the pipeline order keeps alive together
  (Core reuses a consumed microbatch's buffers, ``_get_sample_arguments``, cuda_graphs.py L2231-2260, L2371-2470;
  TE >= 2.7 its outputs too, ``_reuse_graph_input_output_buffers``, cuda_graphs.py L2592-2595, graph.py L306-345),
  with its static output, the output's gradient (``static_grad_outputs``, graph.py L806-821) and the input's gradient;
* ``local``: the same four per runner, the inputs cloned into the pool (``create_fwd_graph``, ``clone_inputs=True``,
  L1137, L1199-1263), the gradients allocated there (``create_bwd_graph``, L1404-1422, L1521-1536); one runner per
  layer reused by every microbatch without pipeline parallelism, one per microbatch of the recorded step with it
  (``get_cudagraph_runner``, L1835, L1867-1932);
* ``full_iteration``: one graph for the forward and backward; its inputs are the step's batch, nothing per layer.

Upper bound and not exact: a captured layer's outputs may be fewer than [s, b, h] x 2 and Core or TE may weak-ref
and reuse more buffers than counted here (cuda_graphs.py L578-585 on TE's weak references); the router's
probabilities and routing map (``moe_router``/``moe_preprocess``) and Core's separate router graphs of the local
implementation (transformer_layer.py L1580-1586) are not counted. The pool's reserved but
free memory (a captured region's intermediates between replays) is outside the allocated figures the phases give.
"""

from __future__ import annotations

import math
from typing import Optional

from megatron_bridge_ext.estimate.report import BUFFERS, Component

STATIC_BUFFERS = "CUDA-graph static inputs, outputs and gradients"


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


def captured_layers(model, kinds: list) -> int:
    """The stage's layers (``kinds``: :func:`..build.stage_layer_kinds`) with a graph: every layer with
    ``cuda_graph_modules`` empty or ``full``, else those ``_layer_is_graphable`` (cuda_graphs.py L2043-2083) admits. A
    GPT layer always has attention; its MLP is MoE or dense by its kind. One graph per layer (Core's TE helper
    graphs each layer as one callable, L2137-2210; a local layer has one manager, transformer_layer.py L555-567)."""
    from megatron.core.transformer.cuda_graph_config import normalize_cuda_graph_modules

    modules = getattr(model, "cuda_graph_modules", None)
    scopes = {s.name for s in normalize_cuda_graph_modules(modules)[0]} if modules else set()
    if not scopes:
        return len(kinds)
    moe = {"moe", "moe_router", "moe_preprocess"}
    count = 0
    for kind in kinds:
        if isinstance(kind, str):
            count += bool(scopes & set(HYBRID_SCOPES.get(kind, ())))
        else:
            from megatron_bridge_ext.estimate.build import is_moe_kind

            count += "attn" in scopes or bool(scopes & (moe if is_moe_kind(kind) else {"mlp"}))
    return count


def buffer_sets(impl: str, *, pp: int, in_flight: float, num_microbatches: int) -> int:
    """Sets of static buffers per captured region (see the module docstring)."""
    if impl == "transformer_engine":
        return math.ceil(in_flight)
    if impl == "local":
        return num_microbatches if pp > 1 else 1
    return 0


def static_buffers(model, *, impl: str, tokens: int, micro_batch: int, element: int, kinds: list, in_flight: float,
                   num_microbatches: int) -> Optional[Component]:
    """The static buffers of the stage's captured graphs (``tokens``: the sequence shard between layers; ``kinds``:
    the stage's layer kinds), None without per-layer graphs."""
    sets = buffer_sets(impl, pp=model.pipeline_model_parallel_size, in_flight=in_flight,
                       num_microbatches=num_microbatches)
    layers = captured_layers(model, kinds)
    if not sets or not layers:
        return None
    per = 4 * tokens * micro_batch * model.hidden_size * element
    return Component(BUFFERS, STATIC_BUFFERS, layers * sets * per,
                     f"formula (upper bound): {layers} captured layer(s) of {len(kinds)} x {sets} buffer set(s) "
                     f"({impl}) x 4 ([{tokens}, {micro_batch}, {model.hidden_size}] input, output and their gradients) "
                     f"x {element} B (estimate.cuda_graphs)")
