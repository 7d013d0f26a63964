"""``mbx plan`` and ``mbx diagnose --plan`` print the estimate's bytes through one function
(:func:`megatron_bridge_ext.sizes.gib_figure`): replaced, it changes both commands' output where they show the
estimate, the plan's phase peaks and the estimate column of the log's comparison.

Both commands run through ``mbx``'s entry point, their checks and printing included; the estimate is the one
built by hand in :mod:`tests.support.render` (no Bridge), stubbed in where each command would build it.
"""

from __future__ import annotations

import re

import pytest

from megatron_bridge_ext import cli, sizes
from megatron_bridge_ext.cli import diagnose as diagnose_cli
from megatron_bridge_ext.cli import plan as plan_cli
from megatron_bridge_ext.estimate.phases import predicted_reports
from tests.support import render as hand
from tests.support.cli import ROOT

pytestmark = [pytest.mark.unit]

LOG = str(ROOT / "tests" / "data" / "diagnose" / "llama-3-8b-2-layers-tp2-dp2.log")
"""Bridge's reports after iterations 1 and 2 of ranks 0 and 1 (TP 2, DP 2), the layout of the hand-built plan."""
PLAN_WORDS = ["--hf-config", str(ROOT / "tests" / "data" / "llama-3-8b" / "config.json"), "--tp", "2", "--dp", "2",
              "--seq", "4096", "--peft", "lora"]
PREDICTED = [hand.FIRST_STEP_PEAK, hand.STEADY_PEAK]
"""The estimate's max allocated after iterations 1 and 2 (their largest phases: the first step, the steady state)."""


@pytest.fixture
def run(monkeypatch, capsys):
    """Each command's output on the hand-built estimate: ``run("plan")``, ``run("diagnose")``."""
    est = hand.estimate()
    monkeypatch.setattr(plan_cli, "_plan", lambda args: hand.plan(80 * 2**30, baseline=est))
    monkeypatch.setattr(diagnose_cli, "_estimate",
                        lambda plan_args, iterations: (predicted_reports(est, iterations),
                                                       {"tp": 2, "pp": 1, "cp": 1, "dp": 2, "ep": 1},
                                                       est.stage_graph_pools))
    argv = {"plan": ["plan", *PLAN_WORDS, "--gpu-memory", "80GiB"], "diagnose": ["diagnose", LOG, "--plan", *PLAN_WORDS]}

    def output(command: str) -> str:
        assert cli.main(argv[command]) == 0
        return capsys.readouterr().out

    return output


def _phase_peaks(plan_text: str) -> list[str]:
    rows = plan_text.split("by phase (the verdict takes the largest):\n")[1].splitlines()[2:5]
    return [re.split(r"\s{2,}", row.strip())[1] for row in rows]


def _estimate_column(diagnose_text: str) -> list[str]:
    rows = diagnose_text.split("each report against the phase it was taken in:\n")[1].splitlines()[2:6]
    return [re.split(r"\s{2,}", row.strip())[5] for row in rows]


def test_both_commands_print_the_estimates_bytes_through_one_function(run, monkeypatch):
    peaks = [hand.ITERATION_1_PEAK, hand.FIRST_STEP_PEAK, hand.STEADY_PEAK]
    assert _phase_peaks(run("plan")) == [f"{p / 2**30:.2f} GiB" for p in peaks]
    assert _estimate_column(run("diagnose")) == [f"{p / 2**30:.2f}" for p in PREDICTED] * 2  # ranks 0 and 1

    monkeypatch.setattr(sizes, "gib_figure", lambda nbytes, **options: f"<{nbytes}>")
    assert _phase_peaks(run("plan")) == [f"<{p}> GiB" for p in peaks]
    assert _estimate_column(run("diagnose")) == [f"<{p}>" for p in PREDICTED] * 2
