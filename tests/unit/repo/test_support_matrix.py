"""The support matrix's recipe section is what the committed coverage rows render to: written by the script from the
benchmark, never by hand (a row changed in one and not the other fails here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("recipe_coverage", ROOT / "scripts" / "recipe_coverage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_matrix_section_is_the_newest_coverage_rows_rendered():
    coverage = _script()
    newest = sorted((ROOT / "benchmarks").glob("*-recipe-coverage.json"))[-1]
    rows = [coverage.Row(**row) for row in json.loads(newest.read_text())]
    page = (ROOT / "docs" / "support-matrix.md").read_text()
    section = page.split(coverage.MATRIX_BEGIN + "\n")[1].split("\n" + coverage.MATRIX_END)[0]
    assert section == coverage.render_matrix(rows)


def test_the_rows_are_every_installed_recipe_once():
    """The percentage is over the installed Bridge's language-model recipes, each counted once."""
    from megatron_bridge_ext.estimate.recipes import language_recipes

    newest = sorted((ROOT / "benchmarks").glob("*-recipe-coverage.json"))[-1]
    specs = [row["spec"] for row in json.loads(newest.read_text())]
    assert len(specs) == len(set(specs))
    assert set(specs) == {recipe.spec for recipe in language_recipes()}
