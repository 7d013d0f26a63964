"""The estimate's phases: iteration 1 without moments, the first step with its transients, the steady state; and the
memory reports Bridge prints, predicted."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_bridge_ext.estimate import phases, static
from megatron_bridge_ext.estimate.report import ACTIVATIONS, BUFFERS, STATIC, TRANSIENT, Component, MemoryEstimate
from tests.support.settings import gpt_stage, optimizer_config

pytestmark = [pytest.mark.unit]

TRAINABLE, DP = 1000, 4
SHARD = TRAINABLE // DP



def _step(optimizer, *, param_bytes=2, grad_bytes=2):
    counts = static.ParameterCounts(dict.fromkeys(static.PARTS, 0),
                                    {**dict.fromkeys(static.PARTS, 0), static.LAYERS: TRAINABLE}, param_bytes)
    rule = static.optimizer_rule(optimizer, param_bytes=param_bytes, data_parallel=DP, context_parallel=1)
    shard = static.optimizer_shard(counts, rule)
    return rule, phases.step_state(optimizer, shard, rule, grad_bytes=grad_bytes)


def test_the_shard_splits_the_optimizer_states_line_into_main_copies_and_moments():
    rule, step = _step(optimizer_config())
    assert (step.masters, step.moments) == (SHARD * 4, SHARD * 8)
    assert step.masters + step.moments == -(-TRAINABLE * rule.bytes_per_parameter // DP)


def test_a_bf16_gradient_buffer_is_copied_to_fp32_in_the_step_and_a_fp32_one_is_not():
    """Core's ``shard_main_param.grad = shard_model_grad.float()``: a copy for bf16, the same tensor for fp32."""
    _, bf16 = _step(optimizer_config(), grad_bytes=2)
    assert [(c.name, c.bytes) for c in bf16.transients] == [(phases.FP32_GRAD_COPIES, SHARD * 4)]
    assert bf16.kept == (phases.FP32_GRAD_COPIES,)
    _, fp32 = _step(optimizer_config(), grad_bytes=4)
    assert fp32.transients == ()


def test_the_precision_aware_optimizer_creates_its_masters_in_the_step_and_unscales_16_bit_states():
    aware = optimizer_config(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                       exp_avg_sq_dtype=torch.bfloat16)
    _, step = _step(aware)
    assert step.masters_in_step
    # two bf16 moments: unscaled inside TE's kernel (v2.14+), no copy; the fp32 master needs none; no grad copy
    assert step.transients == ()
    # one bf16 and one fp32 moment: the bf16 one is copied to fp32 (TE fuses only a bf16 pair)
    _, mixed = _step(optimizer_config(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16))
    assert [(c.name, c.bytes) for c in mixed.transients] == [(phases.UNSCALED_STATES, SHARD * 4)]
    # fp16 moments and an fp16 master: three fp32 copies
    _, half = _step(optimizer_config(use_precision_aware_optimizer=True, exp_avg_dtype=torch.float16,
                                     exp_avg_sq_dtype=torch.float16, main_params_dtype=torch.float16))
    assert [(c.name, c.bytes) for c in half.transients] == [(phases.UNSCALED_STATES, SHARD * 4 * 3)]
    _, fp32_states = _step(optimizer_config(use_precision_aware_optimizer=True))
    assert fp32_states.transients == ()


def _estimate(step, *, activations=2000, transient=100):
    components = [Component(STATIC, "weights: transformer layers", 2000, "w"),
                  Component(STATIC, "gradients (main_grad buffer)", 2000, "g"),
                  Component(STATIC, phases.OPTIMIZER_STATES, step.masters + step.moments, "o"),
                  Component(ACTIVATIONS, "mlp", activations, "a"),
                  Component(BUFFERS, "global memory buffer", 10, "b"),
                  Component(TRANSIENT, "layer backward", transient, "t"),
                  Component(TRANSIENT, "logits at the loss", transient // 2, "t")]
    return MemoryEstimate(stage=0, components=components, settings=gpt_stage(tp=2, dp=DP, cp=1),
                          assumptions=[], activations_per_microbatch={}, in_flight_microbatches=1.0, step=step)


def test_each_phase_holds_its_own_components():
    _, step = _step(optimizer_config())
    est = _estimate(step)
    by_name = {p.name: p for p in est.phases}
    held = 2000 + 2000 + 10
    assert by_name[phases.ITERATION_1].peak_bytes == held + step.masters + 2000 + 100
    assert by_name[phases.FIRST_STEP].peak_bytes == held + step.masters + step.moments + SHARD * 4
    assert by_name[phases.STEADY].peak_bytes == held + step.masters + step.moments + 2000 + 100
    assert by_name[phases.STEADY].peak_bytes == est.steady_peak_bytes
    # what Bridge's report after the step sees allocated: static, buffers and the fp32 copies kept to zero_grad
    assert by_name[phases.FIRST_STEP].after_bytes == held + step.masters + step.moments + SHARD * 4


def test_iteration_1_holds_no_optimizer_state_when_the_precision_aware_optimizer_makes_its_masters_in_the_step():
    """FusedAdam creates the master weights with the moments in its first step (``initialize_state``): iteration 1
    holds none of the optimizer-states line; the first step and the steady state hold all of it."""
    aware = optimizer_config(use_precision_aware_optimizer=True)
    _, step = _step(aware)
    assert step.masters_in_step and (step.masters, step.moments) == (SHARD * 4, SHARD * 8)
    by_name = {p.name: p for p in _estimate(step).phases}
    states = {p: next(c.bytes for c in by_name[p].components if c.name == phases.OPTIMIZER_STATES) for p in by_name}
    assert states == {phases.ITERATION_1: 0, phases.FIRST_STEP: SHARD * 12, phases.STEADY: SHARD * 12}
    held = 2000 + 2000 + 10  # weights, gradients, buffer
    assert by_name[phases.ITERATION_1].peak_bytes == held + 2000 + 100  # activations + the largest transient
    # Core's own optimizer (not precision-aware) makes its fp32 main copies at construction: iteration 1 holds them
    _, plain = _step(optimizer_config())
    first = {p.name: p for p in _estimate(plain).phases}[phases.ITERATION_1]
    assert next(c.bytes for c in first.components if c.name == phases.OPTIMIZER_STATES) == SHARD * 4


def test_the_verdict_takes_the_largest_phase_and_names_it():
    _, step = _step(optimizer_config())
    small_activations = _estimate(step, activations=0, transient=0)
    assert small_activations.peak_phase.name == phases.FIRST_STEP
    assert small_activations.peak_bytes > small_activations.steady_peak_bytes
    assert _estimate(step).peak_phase.name == phases.STEADY


def test_reports_after_iterations_one_and_two_with_log_interval_one():
    """Bridge's ``training_log``: the flag clears after the first report past iteration 1."""
    assert phases.report_iterations(1) == [1, 2]
    assert phases.report_iterations(10) == [10]
    assert phases.report_iterations(1, train_iters=1) == [1]
    assert phases.report_iterations(2, start=4) == [6]


def test_predicted_reports_compare_iteration_one_with_its_own_phases():
    _, step = _step(optimizer_config())
    est = _estimate(step)
    by_name = {p.name: p for p in est.phases}
    first, second = phases.predicted_reports(est)
    assert (first.iteration, second.iteration) == (1, 2)
    assert first.max_allocated_bytes == max(by_name[phases.ITERATION_1].peak_bytes, by_name[phases.FIRST_STEP].peak_bytes)
    assert second.phase == phases.STEADY and second.max_allocated_bytes == by_name[phases.STEADY].peak_bytes
    assert first.ranks == (0, 1)  # DP rank 0 of the stage's two TP ranks
    # allocated when Bridge reports: after a step, with the fp32 gradient copies alive until the next zero_grad
    assert first.allocated_bytes == second.allocated_bytes == by_name[phases.FIRST_STEP].after_bytes


@pytest.mark.parametrize("nbytes", [58_812_345_678, 1_234_567, 999_999_999_999, 0])
def test_gigabytes_round_as_bridge_prints_them(monkeypatch, nbytes):
    """Against Bridge's own ``report_memory``, fed the bytes through torch's memory stats."""
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.training.utils import train_utils

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"allocated_bytes.all.peak": nbytes})
    printed = train_utils.report_memory({"allocated_bytes.all.peak": "mem-max-allocated-bytes"})
    assert phases.bridge_gigabytes(nbytes) == printed["mem-max-allocated-gigabytes"]


def _provider(**fields):
    base = dict(tensor_model_parallel_size=2, sequence_parallel=True, hidden_size=64)
    return types.SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("limit, held", [(0, 3), (2, 2), (9, 3)])
def test_deferred_wgrad_inputs_held_at_the_last_backward(limit, held):
    seq, b, vocab, element, m = 32, 2, 128, 2, 4
    c = phases.wgrad_deferral_component(_provider(), limit=limit, seq=seq, micro_batch=b, vocab_local=vocab,
                                        element=element, num_microbatches=m)
    assert c.bytes == held * (seq // 2 * b * 64 + seq * b * vocab) * element
    assert phases.wgrad_deferral_component(_provider(), limit=None, seq=seq, micro_batch=b, vocab_local=vocab,
                                           element=element, num_microbatches=m) is None


def test_cuda_graphs_are_named_with_the_iteration_their_pools_appear_in():
    note = phases.cuda_graph_note(types.SimpleNamespace(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=3))
    assert "pools appear in iteration 4" in note
    assert phases.cuda_graph_note(types.SimpleNamespace(cuda_graph_impl="none")) is None
