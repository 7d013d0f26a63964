"""`mbx patches`: every patch in a narrow table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.cli import ROOT

pytestmark = pytest.mark.unit


def test_patches_lists_every_patch_in_a_narrow_table_and_says_this_process_is_unpatched():
    from megatron_bridge_ext.patches import PATCHES

    done = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", "patches"], cwd=ROOT, text=True,
                          capture_output=True, timeout=600, env=dict(os.environ, MBX_LOG_LEVEL="WARNING"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:2 + len(PATCHES)]] == [p.name for p in PATCHES]
    assert max(len(line) for line in lines[:2 + len(PATCHES)]) <= 120
    assert "this process: nothing applied" in done.stdout
    verbose = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", "patches", "--verbose"], cwd=ROOT,
                             text=True, capture_output=True, timeout=600, env=dict(os.environ, MBX_LOG_LEVEL="WARNING"))
    assert verbose.returncode == 0 and max(len(line) for line in verbose.stdout.splitlines()) <= 120
    for patch in PATCHES:
        assert f"\n{patch.name}\n" in verbose.stdout
    assert verbose.stdout.count("applied by:") == len(PATCHES)
    te_section = verbose.stdout.split("\nbridge_lora_te_norm_grad\n")[1].split("\n\n")[0]
    assert "megatron_bridge_ext.init() and `mbx run`" in " ".join(te_section.split())


def test_the_plans_import_hooks_are_judged_as_a_process_that_has_not_imported_bridge_would():
    """mbx patches imports Bridge for its report; the hooks that act on that import are judged before it, so each
    reads as in a fresh process that imports nothing (not "not needed: already imported" by the report itself)."""
    import json

    fresh = subprocess.run([sys.executable, "-c", "import json; from dataclasses import asdict; "
                            "from megatron_bridge_ext.patches import registry; "
                            "print(json.dumps([asdict(s) for s in registry.status_all(registry.PLAN_IMPORTS)]))"],
                           cwd=ROOT, text=True, capture_output=True, timeout=600)
    done = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", "patches", "--json"], cwd=ROOT, text=True,
                          capture_output=True, timeout=600, env=dict(os.environ, MBX_LOG_LEVEL="WARNING"))
    assert fresh.returncode == 0 and done.returncode == 0, fresh.stderr + done.stderr
    expected = {s["name"]: s["status"] for s in json.loads(fresh.stdout)}
    reported = {s["name"]: s["status"] for s in json.loads(done.stdout) if s["name"] in expected}
    assert reported == expected
    assert not [s for s in json.loads(done.stdout) if "already imported in this process" in s["reason"]]
