"""On a GPU: the fragmentation workload runs out of memory with the default allocator (keeping the real snapshot
and OOM message with --keep) and completes with expandable segments under the same cap, each in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORKLOAD = "megatron_bridge_ext.device_check.fragmentation_workload"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(mode: str, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-m", WORKLOAD, "--mode", mode, "--json", *extra], capture_output=True, text=True,
                         env=env, timeout=300, cwd=ROOT)
    assert out.stdout.strip(), out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_default_allocator_fails_from_fragmentation():
    result = _run("default")
    assert result["oom"] is True and result["completed"] is False, result
    assert result["diagnosis"] == "fragmentation", result
    assert result["stats"]["reserved_bytes.all.current"] - result["stats"]["allocated_bytes.all.current"] >= 256 << 20


def test_expandable_segments_complete_under_the_same_cap():
    result = _run("expandable")
    assert result["completed"] is True, result
    assert result["reserved_within_cap"] is True, result
    assert result["verify"]["on_device"] is True and result["verify"]["in_effect"] is True, result


def test_keep_writes_the_real_snapshot_and_message_and_the_snapshot_shows_fragmentation(tmp_path):
    from pathlib import Path

    from megatron_bridge_ext.device_check import check
    from megatron_bridge_ext.device_check import fragmentation_workload as workload

    result = _run("default", "--keep", str(tmp_path))
    assert result["kept"] == {"snapshot": str(tmp_path / workload.SNAPSHOT), "message": str(tmp_path / workload.MESSAGE)}
    assert (tmp_path / workload.MESSAGE).read_text().startswith("CUDA out of memory. Tried to allocate 64.00 MiB")
    status, detail = check.judge_snapshot(Path(result["kept"]["snapshot"]), check.PASS)
    assert status == check.PASS, detail
