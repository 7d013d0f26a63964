"""``microbatches_in_flight`` against Megatron Core's own schedule count.

Core's pipeline schedules (``pipeline_parallel/schedules.py``) take their warm-up count from
``get_pp_rank_microbatches``: ``forward_backward_pipelining_with_interleaving`` runs that many model-chunk
forwards (its warm-up loop, ``for k in range(num_warmup_microbatches)``), then each steady-state step runs
one forward (``forward_k = k + num_warmup_microbatches``) before its backward. So the forwards that precede
the first backward on a stage are ``warmup + 1`` model chunks, or every chunk of the step when all of them
are warm-up; each is ``1 / vpp`` of the stage. The count is taken here by calling Core's function itself
with the stage's pipeline rank and sizes, not from our formula.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate.memory import microbatches_in_flight

pytestmark = [pytest.mark.unit]


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def core_forwards_before_first_backward(*, pp: int, vpp, num_microbatches: int, stage: int, group: int) -> int:
    """Model-chunk forwards alive at stage ``stage``'s first backward, counted by Core's schedule helper."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    chunks = vpp or 1
    communicator = SimpleNamespace(pp_group=_Group(pp, stage), virtual_pipeline_model_parallel_size=vpp)
    total, all_warmup, warmup, _ = get_pp_rank_microbatches(num_microbatches, chunks, group,
                                                           p2p_communicator=communicator)
    return total if all_warmup else warmup + 1


CASES = [(2, 2, 4), (4, 2, 8), (4, 5, 16), (4, 5, 4), (8, 3, 8), (8, 3, 64), (2, 4, 2), (4, None, 8), (4, None, 2),
         (8, None, 32)]


@pytest.mark.parametrize("pp, vpp, num_microbatches", CASES)
def test_microbatches_in_flight_are_core_schedules_forwards_before_the_first_backward(pp, vpp, num_microbatches):
    for stage in range(pp):
        core = core_forwards_before_first_backward(pp=pp, vpp=vpp, num_microbatches=num_microbatches, stage=stage,
                                                   group=pp)
        ours = microbatches_in_flight(pp=pp, vpp=vpp, num_microbatches=num_microbatches, stage=stage)
        assert ours * (vpp or 1) == pytest.approx(core), (stage, core, ours)


@pytest.mark.parametrize("pp, vpp, num_microbatches, group", [(4, 5, 16, 8), (2, 3, 12, 6), (4, 2, 9, 5)])
def test_a_larger_microbatch_group_per_virtual_stage_is_counted_as_core_counts_it(pp, vpp, num_microbatches, group):
    core = core_forwards_before_first_backward(pp=pp, vpp=vpp, num_microbatches=num_microbatches, stage=0,
                                               group=group)
    ours = microbatches_in_flight(pp=pp, vpp=vpp, num_microbatches=num_microbatches, stage=0, group_size=group)
    assert ours * vpp == pytest.approx(core)


def test_the_llama_70b_layout_keeps_23_chunks_of_a_fifth_of_stage_0():
    """TP4 PP4 VPP5 DP2, global batch 32, micro-batch 1: 16 microbatches; Core warms up 2 * 3 + 4 * 4 = 22 chunks."""
    assert core_forwards_before_first_backward(pp=4, vpp=5, num_microbatches=16, stage=0, group=4) == 23
    assert microbatches_in_flight(pp=4, vpp=5, num_microbatches=16, stage=0) == pytest.approx(23 / 5)
