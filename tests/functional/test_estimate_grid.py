"""The estimate's activation bytes equal the saved-activation meter on the real 2-rank CPU run, to the byte.

Every TP 1 and TP 2 point of ``tests/support/estimate_grid.py`` (LoRA-A strategies off/regather/
shard_local and full fine-tuning, recompute none/core_attn/mlp/full, SP on/off, MHA and GQA, GeLU and
SwiGLU, fp32 and bf16) runs the real tiny model on both ranks under the meter, and the estimate
traces the same config on fake tensors inside the same process, next to the real process group.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.support.dist_checks import assert_no_problems
from tests.support.estimate_grid import MLA_GRID, MOE_GRID, points_for, problems, run

pytestmark = [pytest.mark.functional]


def _bridge_config_container():
    """The estimate takes a Bridge ConfigContainer; importing it needs Bridge's training dependencies
    (datasets, ...), which the Bridge 0.5.1 test environment does not install."""
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    try:
        from megatron.bridge.training.config import ConfigContainer  # noqa: F401
    except ImportError as error:
        pytest.skip(f"Bridge's ConfigContainer is not importable here ({error})")


@pytest.mark.parametrize("tp", [1, 2])
def test_estimate_equals_the_meter_on_the_real_run(tp):
    from megatron.core import parallel_state

    from megatron_bridge_ext.testing import distributed

    _bridge_config_container()
    distributed.init_from_env(tensor_parallel=tp)
    try:
        rows = run(points_for(tp))
        world_still_works = parallel_state.get_tensor_model_parallel_world_size() == tp and dist.get_world_size() == 2
        found = problems(rows) + ([] if world_still_works else ["the estimate left the real parallel state changed"])
        assert len(rows) >= 4
        assert_no_problems(found, dist.group.WORLD)
    finally:
        distributed.init_from_env(tensor_parallel=2)


def test_moe_estimate_equals_the_meter_on_the_real_run():
    """EP 1 and 2, TP 1 and 2, both dispatchers, shared experts (overlapped and not), LoRA-A off/regather/shard_local
    and full fine-tuning, MoE recompute, dense and MoE layers mixed: the balanced load the estimate states is the
    real load when every token goes to every expert. Top-1 and top-2 of 4 experts route unevenly: the estimate at
    the measured load (linear in each layer's routed tokens) equals the meter, and the estimate at the most loaded
    expert's factor bounds it (tests/support/estimate_grid.py, MOE_GRID)."""
    from megatron_bridge_ext.testing import distributed

    _bridge_config_container()
    try:
        rows = run(MOE_GRID)
        assert len(rows) == len(MOE_GRID)
        assert_no_problems(problems(rows), dist.group.WORLD)
    finally:
        distributed.init_from_env(tensor_parallel=2)


def test_mla_estimate_equals_the_meter_on_the_real_run():
    """Multi-latent attention (Core's MLASelfAttention of the local spec): the query projected directly and through
    its latent, TP 1 and 2, SP on and off, mla_up_proj and full recompute, LoRA, an MoE model; core attention the
    fused stand-in's CPU twin in the real run (tests/support/estimate_grid.py, MLA_GRID)."""
    from megatron_bridge_ext.testing import distributed

    _bridge_config_container()
    try:
        rows = run(MLA_GRID)
        assert len(rows) == len(MLA_GRID)
        assert_no_problems(problems(rows), dist.group.WORLD)
    finally:
        distributed.init_from_env(tensor_parallel=2)
