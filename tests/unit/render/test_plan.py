"""The plan's text and JSON on a plan built by hand (no Bridge, no torch): each figure printed is the one the
numbers give, computed here from the byte counts."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate import phases
from megatron_bridge_ext.estimate.bridge import BridgeEstimate
from megatron_bridge_ext.estimate.report import TRANSIENT, Component
from megatron_bridge_ext.findings import ERROR, Finding, Refused
from megatron_bridge_ext.levers.step import Cost
from megatron_bridge_ext.render import plan as render_plan
from tests.support import render as hand
from tests.support.settings import experts, latent, lora

pytestmark = [pytest.mark.unit]

GIB = 2**30


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.2f} GiB"


def _lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def test_the_verdict_names_the_largest_phase_and_the_usable_memory():
    gpu = 30 * GIB
    usable = int(gpu * 0.9)
    text = render_plan.format_plan(hand.plan(gpu))
    assert hand.STEADY_PEAK > usable  # the case this test is about
    assert _lines(text, "does not fit as is") == [
        f"does not fit as is: peak {_gib(hand.STEADY_PEAK)} ({phases.STEADY}) of {_gib(usable)} usable"]
    assert _lines(text, "device: ") == [
        f"device: {_gib(gpu)}; usable {_gib(usable)} after a 10% margin (without expandable segments: allocator "
        "fragmentation, NCCL buffers, CUDA context, workspaces)"]


def _first_step_largest():
    """The hand-built estimate with the step's copies larger than the activations and the largest transient
    together, so that the first optimizer step holds the peak; and that peak."""
    copies = hand.ACTIVATION + hand.LARGEST + 10**9
    est = hand.estimate()
    est.step = phases.StepState(hand.MASTERS, hand.MOMENTS, masters_in_step=False,
                                transients=(Component(TRANSIENT, phases.FP32_GRAD_COPIES, copies, "copies"),))
    return est, hand.STATIC_BYTES + hand.BUFFER + copies


def test_the_verdict_names_the_first_step_when_it_holds_the_peak():
    est, first_step = _first_step_largest()
    assert first_step > hand.STEADY_PEAK
    gpu = 80 * GIB
    text = render_plan.format_plan(hand.plan(gpu, baseline=est, fits_as_is=first_step <= int(gpu * 0.9)))
    assert _lines(text, "fits as is: ") == [
        f"fits as is: peak {_gib(first_step)} ({phases.FIRST_STEP}) of {_gib(int(gpu * 0.9))} usable"]


def test_a_plan_that_fits_says_so_and_needs_no_lever():
    text = render_plan.format_plan(hand.plan(80 * GIB))
    assert _lines(text, "fits as is: ") == [
        f"fits as is: peak {_gib(hand.STEADY_PEAK)} ({phases.STEADY}) of {_gib(int(80 * GIB * 0.9))} usable"]
    assert _lines(text, "answer: ") == ["answer: no lever needed"]


def _phase_rows(text: str) -> list[list[str]]:
    rows = text.split("by phase (the verdict takes the largest):\n")[1].splitlines()[2:5]
    return [re.split(r"\s{2,}", row.strip())[:3] for row in rows]


def test_each_phase_is_a_row_with_its_peak_in_gib_and_gb_and_the_largest_marked():
    text = render_plan.format_plan(hand.plan(80 * GIB))
    assert hand.STEADY_PEAK > max(hand.ITERATION_1_PEAK, hand.FIRST_STEP_PEAK)  # the steady state is the largest
    assert _phase_rows(text) == [
        [name, _gib(peak), f"{peak / 10**9:.3f} GB"]
        for name, peak in [(phases.ITERATION_1, hand.ITERATION_1_PEAK), (phases.FIRST_STEP, hand.FIRST_STEP_PEAK),
                           (phases.STEADY + " (largest)", hand.STEADY_PEAK)]]


def test_the_mark_follows_the_largest_phase_when_the_first_step_is_it():
    """The first step holds the peak (:func:`_first_step_largest`), and only its row is marked."""
    est, first_step = _first_step_largest()
    rows = _phase_rows(render_plan.format_plan(hand.plan(80 * GIB, baseline=est)))
    assert [row[0] for row in rows] == [phases.ITERATION_1, phases.FIRST_STEP + " (largest)", phases.STEADY]
    assert rows[1][1] == _gib(first_step)


def test_each_report_bridges_log_will_print_is_one_line_in_bridges_gb():
    """log_interval 1: a report after iteration 1 (its largest phase is the first step's) and after iteration 2
    (the steady state); mem-allocated is what a step leaves; TP 2 x DP 2: ranks 0 and 1 print stage 0's."""
    text = render_plan.format_plan(hand.plan(80 * GIB))
    reports = [line.strip() for line in text.splitlines() if line.startswith("  after ")]
    assert reports == [
        f"after 1 iteration(s), stage 0 (ranks 0, 1): mem-max-allocated-gigabytes {hand.FIRST_STEP_PEAK / 10**9} "
        f"({phases.FIRST_STEP}), mem-allocated-gigabytes {hand.AFTER_STEP / 10**9}",
        f"after 2 iteration(s), stage 0 (ranks 0, 1): mem-max-allocated-gigabytes {hand.STEADY_PEAK / 10**9} "
        f"({phases.STEADY}), mem-allocated-gigabytes {hand.AFTER_STEP / 10**9}"]


def test_the_lever_table_and_the_answer_show_the_first_option_that_fits():
    gpu = 30 * GIB
    usable = int(gpu * 0.9)
    tight, loose = hand.STEADY_PEAK - 10**9, usable - 10**9
    options = (hand.option(3, "recompute_modules=['mlp']", tight, usable, cost=Cost(step_time_pct=12.34)),
               hand.option(4, "PP=2", loose, usable, cost=Cost(step_time_pct=-1.5), flags={"recompute": "mlp"},
                           overrides=["model.pipeline_model_parallel_size=2"]))
    text = render_plan.format_plan(hand.plan(gpu, options=options))
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines() if line.startswith(("  3  ", "  4  "))]
    assert rows == [["3", "recompute_modules=['mlp']", _gib(tight), _gib(usable), "no", "+12.3%", "none"],
                    ["4", "PP=2", _gib(loose), _gib(usable), "yes", "-1.5%", "none"]]
    assert _lines(text, "answer: ") == [f"answer: step 4 (PP=2), peak {_gib(loose)}, step time -1.5%"]
    assert "  MemoryConfig(recompute='mlp')" in text.splitlines()
    assert "  overrides: model.pipeline_model_parallel_size=2" in text.splitlines()


def test_a_combined_answer_says_so_and_what_each_of_its_levers_saves():
    gpu = 30 * GIB
    usable = int(gpu * 0.9)
    walked = hand.option(3, "recompute_modules=['mlp']", usable - 10**9, usable, cost=Cost(step_time_pct=31.4))
    combined = hand.option(0, "PP 2->4, DP 4->2", usable - 2 * 10**9, usable, cost=Cost(step_time_pct=8.0),
                           overrides=["model.pipeline_model_parallel_size=4"], saves={"PP 2->4": 3 * GIB})
    text = render_plan.format_plan(hand.plan(gpu, options=(walked,), chosen=combined))
    assert _lines(text, "answer: ") == [f"answer: the fastest fitting combination of the levers (PP 2->4, DP 4->2), "
                                        f"peak {_gib(usable - 2 * 10**9)}, step time +8.0%"]
    assert "  each lever's saving at the peak (the answer without it): PP 2->4 3.00 GiB" in text.splitlines()


def test_bridges_estimate_is_a_table_with_its_difference_from_ours():
    bridge = BridgeEstimate(components=[("weights", 5 * 10**9), ("activations", 20 * 10**9)],
                            total_bytes=25 * 10**9, assumptions=[], caveats=["a caveat"])
    text = render_plan.format_plan(hand.plan(80 * GIB, bridge=bridge))
    table = [re.split(r"\s{2,}", line.strip()) for line in text.split("(not PEFT-aware):\n")[1].splitlines()[2:5]]
    assert table == [["weights", _gib(5 * 10**9)], ["activations", _gib(20 * 10**9)], ["total", _gib(25 * 10**9)]]
    diff = 25 * 10**9 - hand.STEADY_PEAK
    assert f"  Bridge minus ours: {'+' if diff >= 0 else '-'}{_gib(abs(diff))}" in text.splitlines()
    assert "  note: a caveat" in text.splitlines()


def test_a_plan_without_our_estimate_says_why_and_gives_no_verdict():
    refused = Refused("estimate", [Finding("not_modelled", ERROR, "model.x", "not modelled here", "change it")])
    layout = {"tp": 2, "pp": 1, "cp": 1, "ep": 4, "etp": 1, "dp": None, "sequence_parallel": True,
              "seq_length": 2048, "micro_batch": 1, "num_moe_experts": 64, "moe_router_topk": 8}
    text = render_plan.format_plan(hand.plan(80 * GIB, baseline=None, refused=refused, layout=layout),
                                   command_line="mbx plan ARGS")
    assert text.splitlines()[:3] == [
        "$ mbx plan ARGS",
        "config: TP=2 PP=1 CP=1 EP=4 ETP=1 DP=unknown SP=on, seq 2048, micro-batch 1, 64 experts (top-8)",
        "our estimate: not modelled: model.x: not modelled here. Fix: change it"]
    assert text.splitlines()[-1] == ("fits: no verdict without our estimate (Bridge's is not PEFT-aware); exit status "
                                     f"{render_plan.NOT_MODELLED_STATUS}")


@pytest.mark.parametrize("changes, parts", [
    ({}, ["TP=2 PP=1 DP=2 SP=on", "LoRA r=16 on linear_qkv,linear_fc1, sequence_parallel_input_strategy=off",
          "recompute none", "attention fused, local"]),
    ({"peft": None, "vpp": 4, "recompute_granularity": "selective", "recompute_modules": ("mlp",)},
     ["TP=2 PP=1 VPP=4 DP=2", "no PEFT: every parameter trained, recompute selective ['mlp']"]),
    ({"peft": lora(16, ["linear_qkv", "linear_fc1"], kind="dora"), "fp8": "FP8 hybrid"},
     ["bfloat16 with FP8 hybrid, DoRA r=16"]),
    ({"moe": experts(4, experts=64, ep=4, etp=1, imbalance=1.5, topk=8, dispatcher="alltoall")},
     ["TP=2 PP=1 EP=4 ETP=1 DP=2", ", 64 experts (top-8, 16 on this rank, alltoall dispatcher), expert load 1.5 x "
      "balanced on this rank's experts"]),
    ({"mla": latent()}, ["attention fused multi-latent (q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, "
                         "qk_pos_emb_head_dim=64, v_head_dim=128), local"]),
    ({"mla": latent(None, 512, 128, 64, 128)},
     ["multi-latent (q_lora_rank=None (the query projected directly), kv_lora_rank=512"]),
])
def test_the_config_line_says_each_setting(changes, parts):
    line = render_plan.settings_line(replace(hand.SETTINGS, **changes))
    for part in parts:
        assert part in line, (part, line)
    assert "(the default; --peft lora for LoRA)" in render_plan.settings_line(replace(hand.SETTINGS, peft=None),
                                                                               peft_defaulted=True)


def test_the_json_is_the_plans_dict_with_the_devices_default_said():
    result = SimpleNamespace(as_dict=lambda: {"gpu": {"name": "h100"}, "peak_bytes": hand.STEADY_PEAK,
                                              "path": Path("a/b")})
    for defaulted in (True, False):
        text = render_plan.plan_json(result, gpu_defaulted=defaulted)
        assert json.loads(text) == {"gpu": {"name": "h100", "defaulted": defaulted}, "peak_bytes": hand.STEADY_PEAK,
                                    "path": "a/b"}
        assert text.splitlines()[1] == '  "gpu": {'  # indented by two


@pytest.mark.parametrize("micro_batch, smaller", [(1, False), (2, True)])
def test_a_smaller_micro_batch_is_left_only_above_micro_batch_1(micro_batch, smaller):
    """No lever fits: the answer lists what is left; at micro-batch 1 there is no smaller one."""
    est = hand.estimate(replace(hand.SETTINGS, micro_batch=micro_batch))
    text = render_plan.format_plan(hand.plan(GIB, baseline=est, fits_as_is=False))
    answer = _lines(text, "answer: ")
    assert len(answer) == 1 and answer[0].startswith("answer: no combination of the levers fits; more GPUs")
    assert ("a smaller micro-batch" in answer[0]) == smaller


def _peak_row(text: str) -> list[str]:
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines() if line.startswith("  peak  ")]
    assert len(rows) == 1, text
    return rows[0]


def test_the_peak_row_shows_the_phase_the_verdict_names():
    """The first optimizer step holds the peak (:func:`_first_step_largest`): the component table's peak row is
    that phase's, by name and bytes, not the steady state's sum of the rows above it."""
    est, first_step = _first_step_largest()
    text = render_plan.format_plan(hand.plan(80 * GIB, baseline=est))
    row = _peak_row(text)
    assert row[:3] == ["peak", f"{phases.FIRST_STEP} (the largest phase)", _gib(first_step)]
    assert f"({first_step / 10**9:.3f} GB" in row[3]


def test_the_peak_row_is_the_steady_state_sum_when_it_is_the_largest():
    row = _peak_row(render_plan.format_plan(hand.plan(80 * GIB)))
    assert row[:3] == ["peak", "static + activations + buffers + largest transient", _gib(hand.STEADY_PEAK)]
