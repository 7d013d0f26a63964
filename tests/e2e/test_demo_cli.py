"""The README's first command end to end: ``mbx demo`` starts 2 ranks itself and prints its results."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mbx_demo_starts_two_ranks_and_reports_both(tmp_path):
    env = dict(os.environ, MBX_LOG_LEVEL="WARNING")
    command = [sys.executable, "-m", "megatron_bridge_ext.cli", "demo", "--steps", "2",
               "--variants", "baseline", "shard_local", "--json"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    rows = {(r["variant"], r["rank"]): r for r in result["rows"]}
    assert set(rows) == {("baseline", 0), ("baseline", 1), ("shard_local", 0), ("shard_local", 1)}
    base, local = rows[("baseline", 0)], rows[("shard_local", 0)]
    assert local["saved_bytes_per_step"][-1] < base["saved_bytes_per_step"][-1]
    assert [d["strategy"] for d in local["lora_report"]].count("shard_local") == 4
