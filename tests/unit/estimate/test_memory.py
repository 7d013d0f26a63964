"""The estimate's schedules and parallel-size checks: microbatches in flight, impossible layouts named."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate import configs
from megatron_bridge_ext.estimate.memory import microbatches_in_flight, parallel_problems
from megatron_bridge_ext.findings import Refused
from tests.support.estimate import QWEN3_8B

pytestmark = [pytest.mark.unit]


def test_microbatches_in_flight_follow_the_schedules():
    # 1F1B: stage k runs pp - k - 1 warm-up forwards, then one more before its first backward.
    assert microbatches_in_flight(pp=4, vpp=None, num_microbatches=8, stage=0) == 4
    assert microbatches_in_flight(pp=4, vpp=None, num_microbatches=8, stage=3) == 1
    assert microbatches_in_flight(pp=4, vpp=None, num_microbatches=2, stage=0) == 2
    assert microbatches_in_flight(pp=1, vpp=None, num_microbatches=16, stage=0) == 1
    # Interleaved, stage 0: Korthikanti et al.'s pp * (1 + (pp - 1) / (pp * vpp)).
    for pp, vpp in ((4, 2), (4, 5), (8, 3)):
        expected = pp * (1 + (pp - 1) / (pp * vpp))
        assert microbatches_in_flight(pp=pp, vpp=vpp, num_microbatches=64, stage=0) == pytest.approx(expected)


def test_impossible_parallel_sizes_name_the_setting():
    cfg = configs.from_hf_config(QWEN3_8B, configs.Layout(tp=3, seq=8192))
    problems = parallel_problems(cfg.model, micro_batch=1)
    assert problems and problems[0].setting == "model.tensor_model_parallel_size"
    assert "32 attention heads" in problems[0].message
    from megatron_bridge_ext.estimate import estimate

    with pytest.raises(Refused, match="TP=3 does not divide"):
        estimate(cfg)
