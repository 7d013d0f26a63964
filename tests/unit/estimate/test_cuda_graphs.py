"""The CUDA-graph capture phase: the static buffers each implementation's graphs hold, from the shapes Core builds and
the reuse rules of Core and Transformer Engine (module docstring of ``estimate.cuda_graphs``), and the phase in the
estimate of the tiny model (h 64, sequence 32, micro-batch 2, 2 layers, fp32) and in the reports Bridge prints after
the capture."""

from __future__ import annotations

import types

import pytest

from megatron_bridge_ext.estimate import cuda_graphs, phases

pytestmark = [pytest.mark.unit]

S, B, H, E = 512, 1, 1024, 2   # the sequence (no SP, no CP), micro-batch, hidden, bf16 activations
D, EXPERTS = 128, 8            # the rotary dimension (kv_channels), the routed experts
STATIC_HIDDEN = S * B * H * 2  # Core's static hidden states: bf16 whatever the model's dtype (module.py L257-262)
MASK = B * 1 * S * S * 1       # the causal mask of a callable with attention: [b, 1, s, s] bools
ROPE = S * 1 * 1 * D * 4       # the rotary table: [s, 1, 1, d] fp32, one for all samples
HIDDEN = S * B * H * E         # an [s, b, h] activation or its gradient in the model's dtype
PROBS = S * B * EXPERTS * 4    # the router's probabilities, [s x b, experts], moe_router_dtype fp32

DENSE = [0, 0, 0, 0]
MIXED = [0, 1, 1, 0]           # a GPT model's dense (0) and MoE (1) layers


def _model(pp=1, modules="full", shared=None):
    return types.SimpleNamespace(pipeline_model_parallel_size=pp, hidden_size=H, cuda_graph_modules=modules,
                                 position_embedding_type="rope", kv_channels=D, num_attention_heads=8,
                                 rotary_percent=1.0, num_moe_experts=EXPERTS, moe_router_dtype="fp32",
                                 moe_shared_expert_intermediate_size=shared)


def _buffers(impl, kinds, *, pp=1, vpp=1, stage=0, microbatches=4, forwards=(1,), modules="full", shared=None):
    per_chunk = len(kinds) // vpp
    schedule = cuda_graphs.Schedule(pp=pp, vpp=vpp, stage=stage, num_microbatches=microbatches, group=pp,
                                    chunk_forwards=forwards)
    shapes = cuda_graphs.Shapes(tokens=S, micro_batch=B, hidden=H, element=E, seq=S)
    return cuda_graphs.static_buffers(_model(pp, modules, shared), impl=impl, shapes=shapes, kinds=kinds,
                                      layer_chunks=tuple(i // per_chunk for i in range(len(kinds))),
                                      schedule=schedule)


def te_held(sets, *, mask=True, rope=True, router=False, shared=False):
    """What TE's graphs hold: the static input sets, the rotary table, one set of output gradients per output
    signature (the hidden states; the router's two [s, b, h] outputs and probabilities, three with shared experts),
    the last input gradient (bf16, the static input's dtype)."""
    grads = ((3 if shared else 2) * HIDDEN + PROBS) if router else HIDDEN
    return sets * (STATIC_HIDDEN + (MASK if mask else 0)) + (ROPE if rope else 0) + grads + STATIC_HIDDEN


def test_without_pipeline_parallelism_te_holds_one_input_set_per_layer():
    # Core captures one microbatch (cuda_graphs.py L2505-2511): the four layers' forwards all run before a backward
    assert _buffers("transformer_engine", DENSE).bytes == te_held(4)


@pytest.mark.parametrize("stage, warmup", [
    (0, (2 - 0 - 1) * 2 + (2 - 1) * 2),  # schedules.py L931-932: 2 (pp - rank - 1) + (vpp - 1) x group
    (1, (2 - 1 - 1) * 2 + (2 - 1) * 2),
])
def test_with_pp2_vpp2_te_holds_the_inputs_of_the_chunk_forwards_before_their_backward(stage, warmup):
    # the warmup's forwards and one more are alive before the first backward frees a chunk's set; each chunk
    # forward has 2 layers (4 on the stage, 2 chunks); 4 microbatches, microbatch group 2
    sets = (warmup + 1) * 2
    assert _buffers("transformer_engine", DENSE, pp=2, vpp=2, stage=stage).bytes == te_held(sets)


def test_te_reuses_a_set_only_after_its_backward():
    # Core's docstring order (cuda_graphs.py L2803-2813, PP2 VP2, 5 microbatches), 1 layer in chunk 1, 3 in chunk 2:
    # six forwards (3 + 9 samples) before the first backward
    order = [1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
    assert cuda_graphs.reused_sets(order, [1, 3]) == 3 * 1 + 3 * 3
    assert cuda_graphs.reused_sets([1, -1, 1, -1], [4]) == 4


def test_te_moe_router_scope_holds_the_routers_output_gradients_and_no_mask():
    # only the two MoE layers are captured, without attention: no mask, no rotary table
    line = _buffers("transformer_engine", MIXED, modules=["moe_router"])
    assert line.bytes == te_held(2, mask=False, rope=False, router=True)
    shared = _buffers("transformer_engine", MIXED, modules=["moe_router"], shared=1024)
    assert shared.bytes == te_held(2, mask=False, rope=False, router=True, shared=True)


def test_te_whole_moe_layers_hold_one_output_gradient_with_the_dense_ones():
    assert _buffers("transformer_engine", MIXED).bytes == te_held(4)


@pytest.mark.parametrize("kinds, pp, forwards, modules, clones", [
    (DENSE, 1, (1,), "full", 1),                 # one chain of whole layers: only the first input is eager
    (DENSE, 2, (2,), "full", 2),                 # one runner per microbatch: the stage's 2 forwards in flight
    (MIXED, 1, (1,), ["moe_router"], 2 * 2),     # router and post-process graph per MoE layer, eager inputs both
    (list("M*-M"), 1, (1,), ["mamba", "attn"], 2),  # the eager MLP layer breaks the chain
])
def test_local_runners_clone_the_inputs_eager_code_hands_them(kinds, pp, forwards, modules, clones):
    assert _buffers("local", kinds, pp=pp, forwards=forwards, modules=modules).bytes == clones * HIDDEN


@pytest.mark.parametrize("kinds, modules, captured", [
    (list("M*-EM*"), ["attn", "mamba"], 4),       # Mamba and attention layers; the MLP and MoE layers run eagerly
    (list("M*-EM*"), ["moe_router"], 1),
    (list("M*-EM*"), "full", 6),
    (MIXED, ["moe"], 2),                          # a GPT model's MoE layers
    (MIXED, ["mlp"], 2),                          # its dense layers
    (MIXED, ["attn"], 4),                         # every GPT layer has attention
])
def test_the_layers_with_a_graph_are_those_core_finds_graphable(kinds, modules, captured):
    scopes = set() if modules == "full" else set(modules)
    assert sum(cuda_graphs.graphed(kind, scopes) is not None for kind in kinds) == captured


def test_a_full_iteration_graph_and_no_graphs_add_no_static_buffers():
    for impl in ("full_iteration", "none"):
        assert _buffers(impl, DENSE) is None


def test_the_deprecated_switches_read_as_core_reads_them():
    assert cuda_graphs.impl_of(types.SimpleNamespace(cuda_graph_impl="none", enable_cuda_graph=True)) == "local"
    assert cuda_graphs.impl_of(types.SimpleNamespace(external_cuda_graph=True)) == "transformer_engine"


TINY_SEQ, TINY_B, TINY_H, TINY_KV = 32, 2, 64, 64 // 4
TINY_BUFFERS = (2 * (TINY_SEQ * TINY_B * TINY_H * 2 + TINY_B * TINY_SEQ * TINY_SEQ)  # 2 layers' input sets, mask
                + TINY_SEQ * TINY_KV * 4                                          # the rotary table
                + TINY_SEQ * TINY_B * TINY_H * 4                                  # the output gradient, fp32
                + TINY_SEQ * TINY_B * TINY_H * 2)                                 # the last input gradient, bf16
"""The tiny model's (4 heads: kv_channels 16; one microbatch captured without pipeline parallelism)."""


@pytest.fixture(scope="module")
def captured():
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(tp=1, sequence_parallel=False, layers=2, hidden=64, seq=32, micro_batch=2)
    cfg = tiny_config(shape)
    cfg.model.cuda_graph_impl, cfg.model.cuda_graph_warmup_steps = "transformer_engine", 3
    cfg.model.use_te_rng_tracker = True
    return estimate(cfg, attention="fused", transformer_impl="local", device="cpu")


def test_the_capture_phase_is_the_steady_state_and_the_static_buffers(captured):
    by_name = {p.name: p for p in captured.phases}
    steady, graphs = by_name[phases.STEADY], by_name[phases.CUDA_GRAPHS]
    assert graphs.peak_bytes - steady.peak_bytes == TINY_BUFFERS
    assert captured.peak_phase.name == phases.CUDA_GRAPHS


def test_bridge_reports_the_capture_phase_from_the_iteration_after_the_warmup(captured):
    reports = {r.iteration: r for r in phases.predicted_reports(captured, iterations=[3, 4])}
    assert reports[3].phase == phases.STEADY
    assert reports[4].phase == phases.CUDA_GRAPHS and reports[4].unmodelled is None
    assert reports[4].allocated_bytes - reports[3].allocated_bytes == TINY_BUFFERS  # the buffers outlive the step


def test_the_predicted_pool_is_the_static_buffers_and_the_activations_in_flight(captured):
    """The pool diagnose sets a run's private pools beside: the static buffers plus the captured regions'
    intermediates, counted as the traced activations per microbatch times the microbatches in flight; none without
    per-layer graphs."""
    import dataclasses

    pool = captured.stage_graph_pools[0]
    assert pool.static_bytes == TINY_BUFFERS
    assert pool.intermediate_bytes == sum(captured.activations_per_microbatch.values()) * captured.in_flight_microbatches
    assert phases.graph_pool(dataclasses.replace(captured, graph_buffers=None)) is None
