"""The docs' CPU figures are the committed benchmark output, as the command printed it.

``benchmarks/<date>-cpu-bench-memory[-<kind>].{txt,json}`` are written together by one run of
``mbx bench memory --peft KIND --save PREFIX``; the table is re-derived here from the JSON with the
command's own formatter (so the .txt is that run's output, not edited), and the page that shows it
(docs/levers/lora-input.md) must carry each table verbatim. ``benchmarks/<date>-cpu-mbx-demo.{txt,json}``
are the same for ``mbx demo --save PREFIX`` (docs/tools/demo.md), and the ``mbx demo --bridge`` tables
for docs/tools/bridge-loop.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_bridge_ext.demo import bench, train

ROOT = Path(__file__).resolve().parents[3]
BENCH_PAGE = ROOT / "docs" / "levers" / "lora-input.md"
DEMO_PAGE = ROOT / "docs" / "tools" / "demo.md"
BRIDGE_PAGE = ROOT / "docs" / "tools" / "bridge-loop.md"
SAVED = sorted((ROOT / "benchmarks").glob("*-cpu-bench-memory*.json"))
DEMO = sorted((ROOT / "benchmarks").glob("*-cpu-mbx-demo.json"))


def test_every_kind_has_a_committed_benchmark():
    kinds = {json.loads(path.read_text())["shape"]["peft"] for path in SAVED}
    assert kinds == {"lora", "dora", "canonical_lora"}


@pytest.mark.parametrize("saved", SAVED, ids=[path.stem for path in SAVED])
def test_committed_table_is_the_commands_output_and_the_docs_show_it(saved):
    table = saved.with_suffix(".txt").read_text().rstrip("\n")
    assert bench.format_table(json.loads(saved.read_text())) == table
    page = BENCH_PAGE.read_text()
    assert f"```\n{table}\n```" in page, f"{BENCH_PAGE.name} does not show {saved.with_suffix('.txt').name} verbatim"


def test_the_plain_demo_has_one_committed_run():
    assert len(DEMO) == 1, [path.name for path in DEMO]


@pytest.mark.parametrize("saved", DEMO, ids=[path.stem for path in DEMO])
def test_committed_demo_output_is_the_commands_and_the_docs_show_it(saved):
    table = saved.with_suffix(".txt").read_text().rstrip("\n")
    assert train.format_result(json.loads(saved.read_text())) == table
    page = DEMO_PAGE.read_text()
    assert f"```\n{table}\n```" in page, f"{DEMO_PAGE.name} does not show {saved.with_suffix('.txt').name} verbatim"


BRIDGE_DEMO = sorted((ROOT / "benchmarks").glob("*-cpu-mbx-demo-bridge.json"))


def _bridge_rows() -> list[dict]:
    (saved,) = BRIDGE_DEMO
    return json.loads(saved.read_text())["rows"]


def test_committed_bridge_demo_tables_are_the_commands_and_the_docs_show_them():
    from megatron_bridge_ext.demo.bridge_table import format_tables

    (saved,) = BRIDGE_DEMO
    table = saved.with_suffix(".txt").read_text().rstrip("\n")
    assert format_tables(_bridge_rows()) == table
    assert f"```\n{table}\n```" in BRIDGE_PAGE.read_text(), f"{BRIDGE_PAGE.name} does not show {saved.name[:-5]}.txt"


def _with(rows: list[dict], variant: str, field: str, iteration: int, value) -> list[dict]:
    changed = json.loads(json.dumps(rows))
    row = next(r for r in changed if r["variant"] == variant)
    row[field][iteration - 1] = value
    return changed


def test_runs_on_two_cpus_compare_equal_and_print_the_same_tables():
    """Two machines' figures for one iteration (their kernels sum in other orders): within the bound, same table."""
    from megatron_bridge_ext.demo.bridge_table import compare_runs, format_tables

    rows = _bridge_rows()
    here = _with(_with(rows, "baseline", "losses", 3, 5.5129929), "baseline", "grad_norms", 2, 0.8099387)
    there = _with(_with(rows, "baseline", "losses", 3, 5.5129919), "baseline", "grad_norms", 2, 0.8099388)
    assert compare_runs(here, there) == []
    assert format_tables(here) == format_tables(there)


@pytest.mark.parametrize("field, scale", [("losses", 1.001), ("grad_norms", 1.01)])
def test_a_float_figure_beyond_its_bound_differs(field, scale):
    from megatron_bridge_ext.demo.bridge_table import compare_runs

    rows = _bridge_rows()
    value = rows[1][field][0]
    (problem,) = compare_runs(_with(rows, rows[1]["variant"], field, 1, value * scale), rows)
    assert f"{rows[1]['variant']}: iteration 1" in problem


def test_an_exact_figure_must_be_equal():
    from megatron_bridge_ext.demo.bridge_table import compare_runs

    rows = _bridge_rows()
    changed = json.loads(json.dumps(rows))
    changed[0]["lora_input_bytes"] += 4  # one fp32 element
    (problem,) = compare_runs(changed, rows)
    assert problem.startswith("baseline: lora_input_bytes")


def test_the_printed_decimals_are_those_the_bounds_support():
    """Each printed loss / grad norm has the most decimals whose last digit exceeds its rounding bound."""
    from megatron_bridge_ext.demo.bridge_table import FP32_UNIT_ROUNDOFF, format_tables, rounding_bounds

    rows = _bridge_rows()
    bounds = rounding_bounds()
    assert FP32_UNIT_ROUNDOFF < bounds["loss"] < bounds["grad_norm"] < 0.01  # more than one rounding, well under 1%
    lines = format_tables(rows).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("iteration"))
    loss, slash, norm = lines[header + 2].split()[1:4]  # iteration 1, first variant: "loss / grad norm"
    assert slash == "/"
    for cell, field, name in ((loss, "losses", "loss"), (norm, "grad_norms", "grad_norm")):
        digits = len(cell.split(".")[1])
        largest = max(abs(v) for r in rows for v in r[field])
        assert 10.0 ** -digits >= bounds[name] * largest > 10.0 ** -(digits + 1), (cell, bounds[name], largest)
