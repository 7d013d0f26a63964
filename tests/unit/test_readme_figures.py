"""The README's CPU figures are the committed benchmark output, as the command printed it.

``benchmarks/<date>-cpu-bench-memory[-<kind>].{txt,json}`` are written together by one run of
``mbx bench memory --peft KIND --save PREFIX``; the table is re-derived here from the JSON with the
command's own formatter (so the .txt is that run's output, not edited), and the README must carry
each table verbatim. ``benchmarks/<date>-cpu-mbx-demo.{txt,json}`` are the same for ``mbx demo --save PREFIX``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_bridge_ext.demo import bench, train

ROOT = Path(__file__).resolve().parents[2]
SAVED = sorted((ROOT / "benchmarks").glob("*-cpu-bench-memory*.json"))
DEMO = sorted((ROOT / "benchmarks").glob("*-cpu-mbx-demo.json"))


def test_every_kind_has_a_committed_benchmark():
    kinds = {json.loads(path.read_text())["shape"]["peft"] for path in SAVED}
    assert kinds == {"lora", "dora", "canonical_lora"}


@pytest.mark.parametrize("saved", SAVED, ids=[path.stem for path in SAVED])
def test_committed_table_is_the_commands_output_and_the_readme_shows_it(saved):
    table = saved.with_suffix(".txt").read_text().rstrip("\n")
    assert bench.format_table(json.loads(saved.read_text())) == table
    readme = (ROOT / "README.md").read_text()
    assert f"```\n{table}\n```" in readme, f"README does not show {saved.with_suffix('.txt').name} verbatim"


def test_the_plain_demo_has_one_committed_run():
    assert len(DEMO) == 1, [path.name for path in DEMO]


@pytest.mark.parametrize("saved", DEMO, ids=[path.stem for path in DEMO])
def test_committed_demo_output_is_the_commands_and_the_readme_shows_it(saved):
    table = saved.with_suffix(".txt").read_text().rstrip("\n")
    assert train.format_result(json.loads(saved.read_text())) == table
    readme = (ROOT / "README.md").read_text()
    assert f"```\n{table}\n```" in readme, f"README does not show {saved.with_suffix('.txt').name} verbatim"
