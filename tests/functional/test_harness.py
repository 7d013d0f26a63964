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
