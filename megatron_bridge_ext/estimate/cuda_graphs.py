"""What captured CUDA graphs add to a rank's memory once they exist: the static buffers of each captured region.

The graphs' private pool holds, besides those buffers, the intermediates of every captured region: what its layers
save for backward (the traced activations) and their transients. Both implementations capture every graph into one
pool in the order they run (Core's ``transformer/cuda_graphs.py``: ``CudaGraphManager.global_mempool``, L1837-1838,
graphs created in recorded order, L541-620; Transformer Engine's ``make_graphed_callables`` with the schedule's
``_order``, ``transformer_engine/pytorch/graph.py`` L676-680, L693-729, one ``mempool``, L485), so a replay allocates
those intermediates where the eager step did: the same bytes as the activations already counted. What comes on top
are the buffers that stay between replays, each [s, b, h] (the sequence shard under SP):

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

Upper bound and not exact: a captured region's outputs may be fewer than [s, b, h] x 2 and Core or TE may weak-ref
and reuse more buffers than counted here (cuda_graphs.py L578-585 on TE's weak references); the router's
probabilities and routing map (``moe_router``/``moe_preprocess`` regions) are not counted. The pool's reserved but
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


def regions_per_layer(model) -> int:
    """Captured regions per layer: one for the whole layer (``cuda_graph_modules`` empty or ``full``), else one per
    named module (Core's ``normalize_cuda_graph_modules``)."""
    from megatron.core.transformer.cuda_graph_config import normalize_cuda_graph_modules

    modules = getattr(model, "cuda_graph_modules", None)
    scopes = normalize_cuda_graph_modules(modules)[0] if modules else []
    return max(1, len(scopes))


def buffer_sets(impl: str, *, pp: int, in_flight: float, num_microbatches: int) -> int:
    """Sets of static buffers per captured region (see the module docstring)."""
    if impl == "transformer_engine":
        return math.ceil(in_flight)
    if impl == "local":
        return num_microbatches if pp > 1 else 1
    return 0


def static_buffers(model, *, impl: str, tokens: int, micro_batch: int, element: int, layers: int, in_flight: float,
                   num_microbatches: int) -> Optional[Component]:
    """The static buffers of the stage's captured graphs (``tokens``: the sequence shard between layers), None without
    per-layer graphs."""
    sets = buffer_sets(impl, pp=model.pipeline_model_parallel_size, in_flight=in_flight,
                       num_microbatches=num_microbatches)
    if not sets or not layers:
        return None
    regions = regions_per_layer(model)
    per = 4 * tokens * micro_batch * model.hidden_size * element
    return Component(BUFFERS, STATIC_BUFFERS, layers * regions * sets * per,
                     f"formula (upper bound): {layers} layers x {regions} captured region(s) x {sets} buffer set(s) "
                     f"({impl}) x 4 ([{tokens}, {micro_batch}, {model.hidden_size}] input, output and their gradients) "
                     f"x {element} B (estimate.cuda_graphs)")
