"""One reader of memory sizes for every ``mbx`` option: GB (10^9) and GiB (2^30) both, never a bare number;
the figures a GPU is sold by explained where a GB size meets them; GiB the one unit of the output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge_ext.sizes import SizeError, parse_size, sold_as_note

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
STATS = str(ROOT / "tests" / "data" / "memory_stats_capacity.json")


@pytest.mark.parametrize("text, expected", [
    ("40GB", 40 * 10**9), ("40GiB", 40 * 2**30), ("40 gib", 40 * 2**30), ("1.5TiB", 3 * 2**39), ("2TB", 2 * 10**12),
    ("512MiB", 2**29), ("100MB", 10**8), ("3KiB", 3 * 1024), ("4096B", 4096), (".5GiB", 2**29),
])
def test_both_unit_families_are_read(text, expected):
    assert parse_size(text, "--gpu-memory") == expected


@pytest.mark.parametrize("text, fragment", [
    ("40", "--gpu-memory: 40 has no unit. Fix: write 40GiB or 40GB"),
    ("40G", "'G' in '40G' is not a unit. Fix: use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"),
    ("0GiB", "'0GiB' is not a positive size. Fix:"),
    ("1.2.3GiB", "'1.2.3GiB' is not a size. Fix:"),
    ("-8GB", "'-8GB' is not a positive size. Fix:"),
])
def test_bad_sizes_name_the_option_and_the_fix(text, fragment):
    with pytest.raises(SizeError) as error:
        parse_size(text, "--gpu-memory")
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_a_gb_size_that_looks_like_a_sales_figure_gets_a_note():
    note = sold_as_note(80 * 10**9, "--total-memory")
    assert "--total-memory 80GB is 74.51 GiB" in note and "--total-memory 80GiB" in note
    assert sold_as_note(80 * 2**30, "--total-memory") is None
    assert sold_as_note(81559 * 2**20, "--total-memory") is None  # what an H100 80GB reports


def _mbx(*args: str) -> subprocess.CompletedProcess:
    """``mbx`` in a fresh interpreter that also says whether torch got imported."""
    code = ("import sys; from megatron_bridge_ext import cli; rc = cli.main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr); "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("argv, line", [
    (["plan", "--hf-config", "tests/data/qwen3-8b/config.json", "--seq", "4096", "--gpu-memory", "40"],
     "mbx plan: --gpu-memory: 40 has no unit. Fix: write 40GiB or 40GB"),
    (["diagnose", STATS, "--total-memory", "80"], "mbx diagnose: --total-memory: 80 has no unit. Fix: write 80GiB or 80GB"),
], ids=["plan", "diagnose"])
def test_a_bare_number_is_refused_before_torch_is_imported(argv, line):
    done = _mbx(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [line, "torch not imported"]


def test_diagnose_explains_a_gpu_sold_as_80gb():
    """77.6 GiB reserved on a GPU sold as "80GB": 80 GB (74.5 GiB) cannot hold it, 80 GiB can."""
    done = _mbx("diagnose", STATS, "--total-memory", "80GB")
    assert done.returncode == 2 and done.stdout == ""
    line = done.stderr.splitlines()[0]
    assert "--total-memory 80GB is 74.51 GiB (GB = 10^9 bytes), less than the 77.60 GiB reserved" in line
    assert 'a GPU sold as "80GB" holds about 80 GiB' in line and "Fix: --total-memory 80GiB" in line
    fixed = _mbx("diagnose", STATS, "--total-memory", "80GiB")
    assert fixed.returncode == 0 and fixed.stdout.startswith("capacity:")


def test_plan_text_speaks_gib_and_gb_only_beside_published_figures():
    """Every size of the plan is in GiB; a figure in GB appears only in brackets, in a published figure, or beside
    the same figure in GiB (the phase table's column of what Bridge's log prints). Rates (the step time's GB/s, as
    the GPU datasheets give them) are not sizes."""
    from megatron_bridge_ext.cli.plan import format_plan
    from tests.unit.cli.test_plan import small_plan

    result = small_plan(gpu_memory=4 * 10**9)
    text = format_plan(result)
    assert f"device: {4 * 10**9 / 2**30:.2f} GiB;" in text
    for line in text.splitlines():
        for match in re.finditer(r"[\d.]+ GB\b(?!/s)", line):
            assert "published" in line or "(" in line[:match.start()] or "GiB" in line[:match.start()], line


@pytest.mark.parametrize("nbytes, options, expected", [
    (5 * 2**30 + 2**30 // 4, {}, "5.25"), (1536 * 2**30, {}, "1536.00"), (1536 * 2**30, {"grouped": True}, "1,536.00"),
    (2**30 // 2, {"signed": True}, "+0.50"), (-3 * 2**30, {"signed": True}, "-3.00"), (None, {}, "-"),
    (2**30 // 200, {}, "0.00"),  # 5,368,709 bytes, just under 0.005 GiB: rounded down
])
def test_a_gib_figure_is_two_decimals_without_a_unit(nbytes, options, expected):
    from megatron_bridge_ext.sizes import gib_figure

    assert gib_figure(nbytes, **options) == expected


def test_gib_is_the_grouped_figure_with_its_unit():
    from megatron_bridge_ext.sizes import gib

    assert gib(1536 * 2**30) == "1,536.00 GiB" and gib(33 * 2**30 + 2**30 // 2) == "33.50 GiB"
