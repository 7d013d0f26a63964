"""The 2-rank harness itself: ranks, TP group and a real Megatron Core SP round trip."""

import torch
import torch.distributed as dist


def test_two_ranks_share_a_tp_group(tp2):
    assert dist.get_world_size() == 2
    assert tp2.size() == 2
    rank_tensor = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(rank_tensor, group=tp2)
    assert rank_tensor.item() == 1.0


def test_sequence_parallel_gather_then_scatter_round_trips(tp2):
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    local = torch.arange(6.0).reshape(3, 1, 2) + 100 * dist.get_rank()
    full = gather_from_sequence_parallel_region(local, group=tp2)
    assert full.shape == (6, 1, 2)
    torch.testing.assert_close(full[:3], torch.arange(6.0).reshape(3, 1, 2))
    torch.testing.assert_close(scatter_to_sequence_parallel_region(full, group=tp2), local)


def test_groups_built_inside_a_bridge_session_time_out_as_the_tests_process_group(tp2):
    """A Bridge run's groups wait at most MBX_DIST_TIMEOUT_S (rounded up to minutes), whatever its config asks."""
    import datetime

    from megatron.core import parallel_state

    from tests.support.bridge_session import bridge_session, timeout_minutes

    asked = timeout_minutes() + 7  # as a script's cfg.dist.distributed_timeout_minutes would (Bridge's default: 10)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with bridge_session():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, distributed_timeout_minutes=asked)
        timeout = parallel_state.get_tensor_model_parallel_group()._get_backend(device).options._timeout
        parallel_state.destroy_model_parallel()
    assert timeout == datetime.timedelta(minutes=timeout_minutes())


def _registered_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def test_a_new_layout_and_a_bridge_session_leave_no_process_group_behind(tp2):
    """Megatron Core's destroy leaves most of its groups registered (under gloo each keeps polling transport
    threads): a change of layout and a Bridge session's run destroy the groups of the layout before, so the count
    of registered groups after returning to TP=2 is the count TP=2 alone registers."""
    from megatron.core import parallel_state

    from megatron_bridge_ext.testing import distributed
    from tests.support.bridge_session import bridge_session

    distributed.destroy_model_parallel()
    assert _registered_groups() == 1  # the default group alone
    distributed.init_from_env(tensor_parallel=2)
    tp2_alone = _registered_groups()
    distributed.init_from_env(tensor_parallel=1)
    distributed.init_from_env(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1)
    distributed.init_from_env(tensor_parallel=2)
    after_layouts = _registered_groups()
    with bridge_session() as session:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)  # as a Bridge run does
        parallel_state.destroy_model_parallel()  # as Bridge's destroy_global_state does
        session.next_run()
    assert (after_layouts, _registered_groups()) == (tp2_alone, tp2_alone)
