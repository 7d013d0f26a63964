"""The TP 4 points of the estimate's validation grid, on four real CPU ranks (gloo) started by torchrun.

The functional suite runs on two ranks, so TP 4 gets its own launch of ``tests/support/estimate_grid.py``;
every rank compares its meter reading with the estimate and the verdicts of all four come back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.estimate_grid import points_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_tp4_estimate_equals_the_meter_on_four_ranks(tmp_path):
    out = tmp_path / "tp4.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
               "-m", "megatron_bridge_ext.testing.cpu_run", "tests.support.estimate_grid", "--tp", "4", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MBX_DIST_TIMEOUT_S="900",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    verdicts = json.loads(out.read_text())
    points = [p.name for p in points_for(4)]
    assert sorted(v["rank"] for v in verdicts) == [0, 1, 2, 3]
    for verdict in verdicts:
        assert [row["point"] for row in verdict["rows"]] == points
        assert verdict["problems"] == [], verdict["problems"]
