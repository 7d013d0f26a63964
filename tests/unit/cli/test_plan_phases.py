"""``mbx plan``'s phase lines: the one line for a config that fits iteration 1 and runs out of memory later."""

from __future__ import annotations

import types

import pytest

from megatron_bridge_ext.render.plan import _out_of_memory_later
from megatron_bridge_ext.estimate import phases
from megatron_bridge_ext.estimate.report import ACTIVATIONS, STATIC, TRANSIENT, Component, MemoryEstimate
from megatron_bridge_ext.sizes import gib
from tests.support.settings import gpt_stage

pytestmark = [pytest.mark.unit]

MASTERS, MOMENTS = 1000, 2000


def _estimate(activations: int) -> MemoryEstimate:
    step = phases.StepState(MASTERS, MOMENTS, masters_in_step=False)
    components = [Component(STATIC, "weights: transformer layers", 4000, "w"),
                  Component(STATIC, phases.OPTIMIZER_STATES, MASTERS + MOMENTS, "o"),
                  Component(ACTIVATIONS, "mlp", activations, "a"),
                  Component(TRANSIENT, "layer backward", 100, "t")]
    return MemoryEstimate(stage=0, components=components, settings=gpt_stage(), assumptions=[],
                          activations_per_microbatch={}, in_flight_microbatches=1.0, step=step)


def test_fits_iteration_1_and_runs_out_of_memory_in_iteration_2_is_one_line():
    est = _estimate(activations=3000)
    first = 4000 + MASTERS + 3000 + 100  # no moments yet
    usable = first + MOMENTS // 2  # holds iteration 1, not the moments with the activations
    [line] = _out_of_memory_later(types.SimpleNamespace(baseline=est, usable_now=usable))
    assert line.strip() == (f"fits iteration 1 ({gib(first)} in its forward and backward), runs out of memory in "
                            f"iteration 2 at the steady state ({gib(first + MOMENTS)} of {gib(usable)} usable)")
    assert _out_of_memory_later(types.SimpleNamespace(baseline=est, usable_now=first + MOMENTS)) == []
    assert _out_of_memory_later(types.SimpleNamespace(baseline=est, usable_now=first - 1)) == []


def test_runs_out_of_memory_once_the_cuda_graphs_are_captured_names_that_iteration():
    from dataclasses import replace

    from megatron_bridge_ext.estimate.report import BUFFERS

    est = _estimate(activations=3000)
    est.settings = replace(est.settings, reports=replace(est.settings.reports, cuda_graph_first_iteration=4))
    est.graph_buffers = Component(BUFFERS, "CUDA-graph static inputs, outputs and gradients", 500, "g")
    steady = 4000 + MASTERS + MOMENTS + 3000 + 100
    [line] = _out_of_memory_later(types.SimpleNamespace(baseline=est, usable_now=steady))
    assert line.strip().endswith(f"runs out of memory in iteration 4 once its CUDA graphs are captured "
                                 f"({gib(steady + 500)} of {gib(steady)} usable)")


def test_fits_iteration_1_and_runs_out_of_memory_loading_the_checkpoint_before_it_is_one_line():
    """A resumed run whose load holds the states twice (FusedAdam's own loader) beyond iteration 1's peak."""
    reloaded = Component(TRANSIENT, phases.RELOADED_STATES, 2 * (MASTERS + MOMENTS), "r")
    step = phases.StepState(MASTERS, MOMENTS, masters_in_step=False, load=(reloaded,))
    est = _estimate(activations=100)
    est.step = step
    first = 4000 + MASTERS + MOMENTS + 100 + 100  # the loaded moments, activations, the layer's backward
    resume = 4000 + MASTERS + MOMENTS + reloaded.bytes
    [line] = _out_of_memory_later(types.SimpleNamespace(baseline=est, usable_now=first))
    assert line.strip() == (f"fits iteration 1 ({gib(first)} in its forward and backward), runs out of memory in "
                            f"loading the checkpoint's optimizer state before it ({gib(resume)} of {gib(first)} "
                            "usable)")


def test_resume_reaches_the_estimate_and_its_phase_leads_the_json(capsys):
    """``--resume`` on a recipe whose ``checkpoint.load`` is set: the resume phase comes first; without the flag the
    same config is a fresh run."""
    import json

    from megatron_bridge_ext import cli

    argv = ["plan", "--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config",
            "--gpu-memory", "80GiB", "--dp", "2", "model.num_layers=2", "model.hidden_size=64",
            "model.num_attention_heads=4", "model.ffn_hidden_size=256", "model.vocab_size=256",
            "model.share_embeddings_and_output_weights=false", "checkpoint.load=/nonexistent", "--json"]
    names = {}
    for flags in ([], ["--resume"]):
        assert cli.main(argv + flags) == 0
        names[bool(flags)] = [p["name"] for p in json.loads(capsys.readouterr().out)["estimate"]["phases"]]
    assert names[False][0] == phases.ITERATION_1 and phases.RESUME not in names[False]
    assert names[True][0] == phases.RESUME
