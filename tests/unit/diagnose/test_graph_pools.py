"""A run's CUDA-graph private pools beside the capture phase's predicted pool (CPU only).

The measured side is the example run of tests/support/oom_logs.py (TP 2 x DP 2 x PP 2: ranks 4-7 on stage 1) with a
snapshot built from torch's documented structure (tests/support/snapshots.py) or an OOM message with the private-pool
clause; the predictions are :class:`~megatron_bridge_ext.estimate.phases.GraphPool` per stage, as the estimate's
``stage_graph_pools`` holds them.
"""

from __future__ import annotations

import pytest

from megatron_bridge_ext.diagnose import graph_pools
from megatron_bridge_ext.diagnose.collect import diagnose_inputs
from megatron_bridge_ext.estimate.phases import GraphPool
from tests.support import snapshots as snap
from tests.support.oom_logs import GIB, MIB, RUN_DP, RUN_PP, RUN_TP, allocator_oom, prefixed, run_lines, traceback

pytestmark = pytest.mark.unit

STAGE_1 = GraphPool(static_bytes=3 * GIB, intermediate_bytes=5 * GIB)
POOLS = {0: GraphPool(static_bytes=2 * GIB, intermediate_bytes=3 * GIB), 1: STAGE_1}
PRIVATE = (7, 1)


def _run(tmp_path, *, live: int = 0, free: int = 0, oom_private: int = 0):
    """The example run's log (its failing rank's OOM left out), plus rank 4's snapshot holding ``live`` and ``free``
    bytes in a private pool beside 10 GiB of the default pool, and rank 6's OOM message with ``oom_private`` free
    bytes in private pools."""
    lines = [x for x in run_lines(layout=True) if "out of memory" not in x.lower() and "Traceback" not in x
             and 'File "' not in x and "finetune(" not in x]
    inputs = []
    if oom_private:
        message = allocator_oom(2 * GIB, total=80 * GIB, free=100 * MIB, allocated=60 * GIB, reserved=79 * GIB,
                                private=oom_private)
        lines += [prefixed(6, x) for x in traceback(message)]
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    inputs.append(str(log))
    if live or free:
        blocks = [snap.block(live)] + ([snap.block(free, state="inactive")] if free else [])
        segments = [snap.segment([snap.block(10 * GIB)]), snap.segment(blocks, pool_id=PRIVATE)]
        inputs.append(snap.dump(snap.snapshot(segments), tmp_path / "oom_rank4.snapshot.pickle"))
    return diagnose_inputs(inputs, sizes={"tp": RUN_TP, "pp": RUN_PP, "dp": RUN_DP})


def test_a_snapshots_private_segments_within_the_prediction(tmp_path):
    """6 GiB in the private pool (5 live, 1 free) against stage 1's 3 + 5 GiB: 2 GiB to spare; the default pool's
    10 GiB segment is no part of it."""
    [row] = graph_pools.compare(_run(tmp_path, live=5 * GIB, free=1 * GIB), POOLS)
    assert (row["rank"], row["stage"], row["source"]) == (4, 1, graph_pools.SNAPSHOT)
    assert row["pool_bytes"] == 6 * GIB and row["free_bytes"] == 1 * GIB
    assert row["predicted_pool_bytes"] == 8 * GIB and row["predicted_static_bytes"] == 3 * GIB
    assert row["verdict"].startswith("within the prediction (2.00 GiB to spare)")
    [line] = graph_pools.lines([row])
    assert "measured 6.00 GiB in private pools" in line and "predicted 8.00 GiB by the 'CUDA-graph capture' phase" in line
    assert "static buffers 3.00 GiB + captured regions' intermediates 5.00 GiB" in line


def test_beyond_the_prediction_by_what_the_free_blocks_cover(tmp_path):
    """7 live + 3 free = 10 GiB against 8: 2 GiB beyond, within the 3 GiB free: the pool's reserve, not live tensors."""
    [row] = graph_pools.compare(_run(tmp_path, live=7 * GIB, free=3 * GIB), POOLS)
    assert row["verdict"].startswith("beyond the prediction by 2.00 GiB, which the pools' 3.00 GiB of free blocks cover")


def test_beyond_the_prediction_by_more_than_the_free_blocks(tmp_path):
    """11 live + 1 free = 12 GiB against 8: 4 GiB beyond, more than the 1 GiB free: live tensors the phase misses."""
    [row] = graph_pools.compare(_run(tmp_path, live=11 * GIB, free=1 * GIB), POOLS)
    assert row["verdict"].startswith("beyond the prediction by 4.00 GiB, more than the pools' 1.00 GiB of free blocks")


@pytest.mark.parametrize("private, start", [(3 * GIB, "the message gives only the pools' free blocks"),
                                            (9 * GIB, "beyond the prediction: the free blocks alone exceed it by 1.00 GiB")])
def test_an_oom_message_gives_the_pools_free_blocks_only(tmp_path, private, start):
    """Rank 6 (stage 1): 3 GiB free says nothing of the pool's size against 8 GiB; 9 GiB free already exceeds it."""
    [row] = graph_pools.compare(_run(tmp_path, oom_private=private), POOLS)
    assert (row["rank"], row["stage"], row["source"], row["pool_bytes"]) == (6, 1, graph_pools.OOM, None)
    assert abs(row["free_bytes"] - private) <= 0.005 * GIB
    assert row["verdict"].startswith(start)


def test_without_a_capture_phase_nothing_to_set_beside(tmp_path):
    [row] = graph_pools.compare(_run(tmp_path, live=5 * GIB), {0: None, 1: None})
    assert row["predicted_pool_bytes"] is None and "no capture phase" in row["verdict"]
    [row] = graph_pools.compare(_run(tmp_path, live=5 * GIB), {0: STAGE_1})
    assert "was not estimated" in row["verdict"]


def test_a_run_without_private_pools_gives_no_row(tmp_path):
    assert graph_pools.compare(_run(tmp_path), POOLS) == []
