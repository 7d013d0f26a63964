"""The docs' estimate figures (docs/tools/plan.md) are the committed output of the commands that printed them.

The ``test_consistency_...`` tests compare the pages with the committed files and run nothing; the
``test_rerun_...`` tests run the program again (the committed ``mbx plan`` command, the estimate of each
case ``scripts/estimate_published.py`` wrote) and find the committed figures in what it gives now.

``benchmarks/<date>-mbx-plan-qwen3-8b-40GB.txt`` is ``mbx plan``'s output (its first line is the
command), shown verbatim in docs/tools/plan.md; ``benchmarks/<date>-qwen3-8b-lora-estimate.json`` is written
by ``scripts/estimate_published.py --json`` in the same run as its ``.txt``, and every figure of the
page's table of the published peaks is re-derived here from that JSON.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PLANS = sorted((ROOT / "benchmarks").glob("*-mbx-plan-*.txt"))
PUBLISHED = sorted((ROOT / "benchmarks").glob("*-qwen3-8b-lora-estimate.json"))
PUBLISHED_MOE = sorted((ROOT / "benchmarks").glob("*-qwen3-30b-a3b-lora-estimate.json")) + \
    sorted((ROOT / "benchmarks").glob("*-gpt-oss-120b-lora-estimate.json"))

pytestmark = pytest.mark.unit


PLAN_PAGE = ROOT / "docs" / "tools" / "plan.md"


def _page() -> str:
    return PLAN_PAGE.read_text()


@pytest.mark.parametrize("saved", PLANS, ids=[p.stem for p in PLANS])
def test_consistency_the_plan_page_shows_the_committed_plan_output_verbatim(saved):
    text = saved.read_text().rstrip("\n")
    assert text.startswith("$ mbx plan ")
    assert f"```\n{text}\n```" in _page()
    plot = saved.with_suffix(".png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.name in _page()


@pytest.mark.parametrize("saved", PLANS, ids=[p.stem for p in PLANS])
def test_the_levers_table_of_the_committed_plan_is_narrow(saved):
    """The levers table fits 120 columns: why an option does not apply is a note below it, not a cell."""
    text = saved.read_text()
    table = text.split("\n  step  option")[1].split("\nwhy not, constraints")[0]
    assert table.count("\n") >= 2 and all(len(line) <= 120 for line in ("  step  option" + table).splitlines())


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def _diff(value: float, reference: float) -> str:
    return f"{(value - reference) / 1e9:+.3f} GB ({(value - reference) / reference:+.1%})"


def _saving_row(records: list[dict]) -> str:
    """The page's row of the first case's figures less the second's (Bridge's LoRA without and with regather)."""
    saving = [records[0][k] - records[1][k] for k in ("published_bytes", "estimate_bytes", "bridge_estimate_bytes")]
    return (f"| saving (first - second) | {_gb(saving[0])} | {_gb(saving[1])} | {_diff(saving[1], saving[0])} | "
            f"{_gb(saving[2])} | {_diff(saving[2], saving[0])} |")


def test_consistency_the_published_peak_table_is_derived_from_the_committed_json():
    assert len(PUBLISHED) == 1
    records = json.loads(PUBLISHED[0].read_text())
    assert len(records) == 2
    page = _page()
    for record in records:
        published, ours, bridge = (record[k] for k in ("published_bytes", "estimate_bytes", "bridge_estimate_bytes"))
        assert ours == record["estimate"]["peak_bytes"]
        row = (f" | {_gb(published)} | {_gb(ours)} | {_diff(ours, published)} | {_gb(bridge)} | "
               f"{_diff(bridge, published)} |")
        assert row in page, row
    row = _saving_row(records)
    assert row in page, row
    # The .txt written in the same run shows the same rows.
    text = PUBLISHED[0].with_suffix(".txt").read_text()
    assert _gb(records[0]["estimate_bytes"]) in text and _gb(records[1]["estimate_bytes"]) in text


def _or_dash(value, text):
    return "-" if value is None else text


@pytest.mark.parametrize("saved", PUBLISHED_MOE, ids=[p.stem for p in PUBLISHED_MOE])
def test_consistency_the_published_moe_peak_tables_are_derived_from_the_committed_json(saved):
    """Each MoE row of the page's tables is re-derived from the JSON written with its .txt; the shard_local row has
    no published figure, and the saving row compares Bridge's LoRA with and without its regather flag."""
    records = json.loads(saved.read_text())
    assert [r["case"].split(" with ")[0] for r in records] == ["Bridge's LoRA", "Bridge's LoRA", "our LoRA"]
    page = _page()
    for record in records:
        published, ours, bridge = (record[k] for k in ("published_bytes", "estimate_bytes", "bridge_estimate_bytes"))
        assert ours == record["estimate"]["peak_bytes"]
        row = (f"| {record['case']} | {_or_dash(published, _gb(published or 0))} | {_gb(ours)} | "
               f"{_or_dash(published, published and _diff(ours, published))} | {_gb(bridge)} | "
               f"{_or_dash(published, published and _diff(bridge, published))} |")
        assert row in page, row
    row = _saving_row(records)
    assert row in page, row
    text = saved.with_suffix(".txt").read_text()
    assert text.startswith("$ PYTHONPATH=$PWD python scripts/estimate_published.py --model ")
    assert all(_gb(r["estimate_bytes"]) in text for r in records)


HYBRID_PAGE = ROOT / "docs" / "tools" / "estimate-precision-hybrid.md"
HYBRID_PLAN = ROOT / "benchmarks" / "2026-12-01-nemotron-3-nano-peft-plan.txt"


def test_consistency_the_hybrid_pages_nemotron_figures_are_the_committed_plan_output():
    """The page abridges the Nemotron 3 Nano plan; its command and every figure line it shows are the committed
    output's own lines."""
    text, page = HYBRID_PLAN.read_text().splitlines(), HYBRID_PAGE.read_text()
    assert text[0].startswith("$ mbx plan ") and text[0] in page.splitlines()
    shown = [line for line in text if line.startswith(("  activations  mamba ", "  peak  ", "  total  ", "fits as is"))]
    assert len(shown) == 4
    for line in shown:
        assert line in page.splitlines(), line


def _rerun_plan(saved: Path, capsys, monkeypatch) -> dict:
    """The committed ``mbx plan`` command (its first line) run again from the repository root, as JSON, no plot."""
    from megatron_bridge_ext import cli

    argv = shlex.split(saved.read_text().splitlines()[0])
    assert argv[:3] == ["$", "mbx", "plan"]
    argv = argv[3:]
    if "--plot" in argv:
        at = argv.index("--plot")
        del argv[at:at + 2]
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("saved", [*PLANS, HYBRID_PLAN], ids=[p.stem for p in [*PLANS, HYBRID_PLAN]])
def test_rerun_the_committed_plans_peak_and_bridges_total_are_what_the_command_gives_now(saved, capsys, monkeypatch):
    report = _rerun_plan(saved, capsys, monkeypatch)
    lines = saved.read_text().splitlines()
    [peak] = [line for line in lines if line.startswith("  peak  ")]
    estimate = report["estimate"]["peak_bytes"]
    assert f"{estimate / 2**30:.2f} GiB  ({estimate / 1e9:.3f} GB" in peak, peak
    [total] = [line for line in lines if line.startswith("  total  ")]
    assert total.split()[-2:] == [f"{report['bridge_estimate']['total_bytes'] / 2**30:,.2f}", "GiB"], total


def _published_script():
    spec = importlib.util.spec_from_file_location("estimate_published", ROOT / "scripts" / "estimate_published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("saved", PUBLISHED + PUBLISHED_MOE, ids=[p.stem for p in PUBLISHED + PUBLISHED_MOE])
def test_rerun_the_committed_published_estimates_are_what_the_estimate_gives_now(saved):
    """Each case of the committed JSON estimated again with the script's own config: the same bytes, ours and
    Bridge's."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.bridge import bridge_estimate

    script = _published_script()
    name = saved.stem.split("-", 3)[3].removesuffix("-lora-estimate")
    model = script.MODELS[name]
    path = str(ROOT / "tests" / "data" / name / "config.json")
    records = json.loads(saved.read_text())
    assert [r["case"] for r in records] == list(model["published"])
    for record in records:
        cfg = script._config(path, model, record["case"])
        assert estimate(cfg).peak_bytes == record["estimate_bytes"], record["case"]
        assert bridge_estimate(cfg, data_parallel_size=model["dp"]).total_bytes == record["bridge_estimate_bytes"]
