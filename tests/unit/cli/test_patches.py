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
