"""Megatron-FSDP's sharded buffers, measured: Megatron Core's ``ParamAndGradBuffer`` over the tiny GPT on the 2 ranks
(one data-parallel group) against the estimate's lines for the same config, every sharding strategy."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge_ext.testing.tiny_model import TinyGPTShape
from tests.support.fsdp_buffers import fsdp_buffers, held_bytes

SHAPE = TinyGPTShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, seq=64, micro_batch=1, vocab=128, tp=1,
                     sequence_parallel=False, dtype="bfloat16", swiglu=True)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ADAM = 4 + 4
"""fp32 moments per element: the optimizer steps Megatron-FSDP's fp32 main weights."""


def _estimated(strategy: str) -> dict:
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    cfg = tiny_config(SHAPE)
    cfg.ddp.use_megatron_fsdp, cfg.ddp.data_parallel_sharding_strategy = True, strategy
    cfg.checkpoint.save = cfg.checkpoint.load = None
    est = estimate(cfg, data_parallel_size=torch.distributed.get_world_size(), attention="local",
                   transformer_impl="local", device="cpu")
    return {c.name: c.bytes for c in est.components}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_estimates_fsdp_lines_are_the_bytes_of_cores_buffers_on_rank_0(strategy):
    from megatron_bridge_ext.testing import distributed
    from megatron_bridge_ext.testing.tiny_model import build_gpt

    distributed.init_from_env(tensor_parallel=1)
    model = build_gpt(SHAPE).to(torch.bfloat16)
    native = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = fsdp_buffers(model, strategy)
    shards = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shards, measured)
    if torch.distributed.get_rank() != 0:
        return
    est = _estimated(strategy)
    weights = native if strategy == "no_shard" else held_bytes(measured, "model_weight_buffer")
    assert est["weights: Megatron-FSDP model weights"] == weights
    assert est["gradients (Megatron-FSDP main gradients)"] == held_bytes(measured, "main_grad_buffer")
    assert est["optimizer states"] == held_bytes(measured, "main_weight_buffer") + measured["optimizer"] * ADAM
    if strategy != "no_shard":  # rank 1 holds shards of the same sizes (the padding is its shard's tail)
        assert shards[1]["main_weight_buffer"] == shards[0]["main_weight_buffer"]
