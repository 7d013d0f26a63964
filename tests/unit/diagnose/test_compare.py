"""A log's reports beside predictions of the same iteration and stage, and the gap's parts (CPU only).

The predictions are records of the shape :func:`megatron_bridge_ext.estimate.phases.predicted_reports`
returns; the measured side is the example run of tests/support/oom_logs.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest

from megatron_bridge_ext.diagnose import compare
from megatron_bridge_ext.diagnose.collect import diagnose_inputs
from tests.support.oom_logs import (GIB, MIB, RUN_DP, allocator_oom, bridge_memory_line, bridge_stats, prefixed,
                                    run_lines, run_max_allocated, traceback)

pytestmark = pytest.mark.unit
GB = 10**9


@dataclass(frozen=True)
class Predicted:
    iteration: int
    phase: str
    stage: int
    ranks: tuple
    max_allocated_bytes: int
    allocated_bytes: int
    unmodelled: Optional[str] = None


PREDICTED = [Predicted(1, "iteration 1", 0, (0, 1), 33 * GB, 20 * GB), Predicted(1, "iteration 1", 1, (4, 5), 36 * GB, 20 * GB),
             Predicted(2, "steady state", 0, (0, 1), 40 * GB, 20 * GB),
             Predicted(2, "steady state", 1, (4, 5), 44 * GB, 20 * GB, "CUDA graphs pools from iteration 3")]


def _run(tmp_path, lines, **sizes):
    path = tmp_path / "train.log"
    path.write_text("\n".join(lines) + "\n")
    return diagnose_inputs([str(path)], sizes={"dp": RUN_DP, **sizes})


def test_each_report_meets_the_prediction_of_its_iteration_and_stage(tmp_path):
    rows = compare.compare(_run(tmp_path, run_lines()), PREDICTED)
    assert [(r["rank"], r["iteration"], r["phase"]) for r in rows][:2] == [(0, 1, "iteration 1"), (0, 2, "steady state")]
    by = {(r["rank"], r["iteration"]): r for r in rows}
    row = by[(5, 2)]
    assert row["stage"] == 1 and row["predicted_max_allocated_bytes"] == 44 * GB
    # Bridge's 5 significant digits of (30 + 5 + 10) GB are exact: the gap is the builder's figure less the estimate
    assert row["gap_bytes"] == run_max_allocated(5, 2) - 44 * GB
    assert row["reserved_minus_allocated_bytes"] == 52 * GB - run_max_allocated(5, 2)
    assert row["unmodelled"] == "CUDA graphs pools from iteration 3"
    assert by[(4, 1)]["gap_bytes"] == run_max_allocated(4, 1) - 36 * GB


def test_the_oom_message_gives_the_private_pools_and_the_memory_outside_the_allocator(tmp_path):
    message = allocator_oom(2 * GIB, total=80 * GIB, free=100 * MIB, allocated=60 * GIB, reserved=79 * GIB,
                            private=3 * GIB, this_process=79 * GIB + 700 * MIB)
    lines = [prefixed(4, bridge_memory_line(4, 1, bridge_stats(20 * GB, 35 * GB, 50 * GB, 52 * GB)))]
    lines += [prefixed(4, x) for x in traceback(message)]
    row = compare.compare(_run(tmp_path, lines, tp=2, pp=2), PREDICTED)[0]
    assert abs(row["private_pool_bytes"] - 3 * GIB) <= 0.005 * GIB
    assert abs(row["process_minus_reserved_bytes"] - 700 * MIB) <= 0.01 * GIB + 0.005 * MIB


def test_a_report_without_a_prediction_says_not_estimated(tmp_path):
    rows = compare.compare(_run(tmp_path, run_lines()), [p for p in PREDICTED if p.stage == 0])
    text = "\n".join(compare.lines(rows))
    assert {r["phase"] for r in rows if r["rank"] in (4, 5)} == {None}
    assert "not estimated" in text and "GiB (2^30 bytes)" in text
