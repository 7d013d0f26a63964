"""The docs' tables of the published memory levers (docs/tools/plan.md) show the committed output of
``scripts/estimate_published.py --lever all --json``: every estimate and its difference from a published figure
are re-derived here from that JSON, and every published figure from the script's own cases."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SAVED = sorted((ROOT / "benchmarks").glob("*-estimate-published-levers.json"))

pytestmark = pytest.mark.unit


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def _lever_records(saved: Path) -> list[dict]:
    return [r for r in json.loads(saved.read_text()) if "lever" in r]


@pytest.mark.parametrize("saved", SAVED, ids=[p.stem for p in SAVED])
def test_consistency_each_lever_case_s_estimate_is_on_the_plan_page(saved):
    page = (ROOT / "docs" / "tools" / "plan.md").read_text()
    assert saved.name in page or saved.with_suffix(".txt").name in page
    records = _lever_records(saved)
    assert records
    for record in records:
        estimate, published = record["estimate_bytes"], record["published_bytes"]
        assert _gb(estimate) in page, record["case"]
        if published is not None:
            difference = f"{(estimate - published) / 1e9:+.3f} GB ({(estimate - published) / published:+.1%})"
            assert difference in page, (record["lever"], record["case"])


@pytest.mark.parametrize("saved", SAVED, ids=[p.stem for p in SAVED])
def test_consistency_the_committed_cases_are_the_script_s(saved):
    """The JSON holds every case of every lever, in the script's order, with the published figure it states."""
    spec = importlib.util.spec_from_file_location("estimate_published", ROOT / "scripts" / "estimate_published.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cases = [(lever.title, case.label, case.published) for levers in script.LEVERS.values() for lever in levers
             for case in lever.cases]
    assert [(r["lever"], r["case"], r["published_bytes"]) for r in _lever_records(saved)] == cases
