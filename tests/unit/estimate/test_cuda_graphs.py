"""The CUDA-graph capture phase: the captured graphs' static buffers from the shapes and the buffer sets each
implementation keeps, and the phase in the estimate of the tiny model (h 64, sequence 32, micro-batch 2, 2 layers,
fp32) and in the reports Bridge prints after the capture."""

from __future__ import annotations

import types

import pytest

from megatron_bridge_ext.estimate import cuda_graphs, phases

pytestmark = [pytest.mark.unit]

S, B, H, E = 512, 1, 1024, 2
ONE = 4 * S * B * H * E
"""A captured region's input, output and their gradients, [s, b, h] each."""


def _model(pp=1, modules="full"):
    return types.SimpleNamespace(pipeline_model_parallel_size=pp, hidden_size=H, cuda_graph_modules=modules)


DENSE = [0, 0, 0, 0]


@pytest.mark.parametrize("impl, pp, in_flight, microbatches, modules, expected", [
    ("transformer_engine", 1, 1.0, 8, "full", 4 * 1 * ONE),
    ("transformer_engine", 4, 2.5, 8, "full", 4 * 3 * ONE),          # the microbatches the order keeps together
    ("transformer_engine", 4, 2.0, 8, ["attn", "mlp"], 4 * 2 * ONE),  # one graph per layer, whatever it captures
    ("local", 1, 1.0, 8, [], 4 * 1 * ONE),                            # one runner per layer, reused
    ("local", 2, 2.0, 8, "full", 4 * 8 * ONE),                        # one runner per microbatch of the step
])
def test_the_static_buffers_are_four_hidden_states_per_captured_layer_and_buffer_set(impl, pp, in_flight,
                                                                                    microbatches, modules, expected):
    line = cuda_graphs.static_buffers(_model(pp, modules), impl=impl, tokens=S, micro_batch=B, element=E,
                                      kinds=DENSE, in_flight=in_flight, num_microbatches=microbatches)
    assert line.bytes == expected and line.name == cuda_graphs.STATIC_BUFFERS


@pytest.mark.parametrize("kinds, modules, captured", [
    (list("M*-EM*"), ["attn", "mamba"], 4),       # Mamba and attention layers; the MLP and MoE layers run eagerly
    (list("M*-EM*"), ["moe_router"], 1),
    (list("M*-EM*"), "full", 6),
    ([0, 1, 1, 0], ["moe"], 2),                   # a GPT model's MoE layers
    ([0, 1, 1, 0], ["mlp"], 2),                   # its dense layers
    ([0, 1, 1, 0], ["attn"], 4),                  # every GPT layer has attention
])
def test_the_layers_with_a_graph_are_those_core_finds_graphable(kinds, modules, captured):
    assert cuda_graphs.captured_layers(_model(modules=modules), kinds) == captured


def test_a_full_iteration_graph_and_no_graphs_add_no_static_buffers():
    for impl in ("full_iteration", "none"):
        assert cuda_graphs.static_buffers(_model(), impl=impl, tokens=S, micro_batch=B, element=E, kinds=DENSE,
                                          in_flight=1.0, num_microbatches=8) is None


def test_the_deprecated_switches_read_as_core_reads_them():
    assert cuda_graphs.impl_of(types.SimpleNamespace(cuda_graph_impl="none", enable_cuda_graph=True)) == "local"
    assert cuda_graphs.impl_of(types.SimpleNamespace(external_cuda_graph=True)) == "transformer_engine"


TINY_BUFFERS = 2 * 1 * 1 * 4 * 32 * 2 * 64 * 4
"""The tiny model's: 2 layers (the whole layer captured) x one microbatch in flight x 4 [32, 2, 64] fp32."""


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
