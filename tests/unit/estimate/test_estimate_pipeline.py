"""The estimate of a tiny model under uneven pipeline splits against Megatron Core's real model chunks.

For each estimated stage, every model chunk Core builds for it (Bridge's ``provide(vp_stage=v)`` on that pipeline
rank, with the virtual pipeline size in Core's parallel state) runs one microbatch under the saved-tensor meter;
the expected activations are each chunk's saved bytes times the forwards of that chunk in flight (Core's schedule
table), the expected weights the chunks' parameters. The estimate traces the stage as one model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from megatron_bridge_ext.estimate import memory, pipeline
from megatron_bridge_ext.estimate.report import ACTIVATIONS

pytestmark = [pytest.mark.unit]

NUM_MICROBATCHES = 6


def _config(layers: int, pp: int, vpp=None, **split):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    cfg = tiny_config(TinyGPTShape(tp=1, layers=layers, heads=4, kv_heads=2, hidden=64, ffn=128, seq=32))
    cfg.model.pipeline_model_parallel_size, cfg.model.pipeline_dtype = pp, torch.float32
    cfg.model.virtual_pipeline_model_parallel_size = vpp
    cfg.model.microbatch_group_size_per_vp_stage = pp if vpp else None
    for name, value in split.items():
        setattr(cfg.model, name, value)
    return cfg


def _core_chunks(prepared, stage: int) -> list[tuple[int, int]]:
    """(saved bytes of one microbatch, parameters) of each model chunk Core builds on pipeline rank ``stage``."""
    from megatron.core import parallel_state
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from megatron_bridge_ext.estimate.build import build_rank_model
    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.estimate.trace import trace_microbatch

    provider = prepared.provider
    vpp = provider.virtual_pipeline_model_parallel_size
    out = []
    with fake_parallel_world(tp=1, pp=provider.pipeline_model_parallel_size, cp=1, rank=stage, device="cpu"):
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
        for chunk in range(vpp or 1):
            mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
            chunk_provider = copy.deepcopy(provider)
            chunk_provider.provide = functools.partial(type(provider).provide, chunk_provider,
                                                       vp_stage=chunk if vpp else None)
            model = build_rank_model(chunk_provider, None, attention="fused", mode=mode, device="cpu",
                                     dtype=prepared.dtype, transformer_impl="local")
            traced = trace_microbatch(model, mode, seq=prepared.seq, micro_batch=prepared.micro_batch,
                                      hidden=provider.hidden_size, dtype=prepared.dtype, device="cpu",
                                      sequence_parallel_tp=1)
            out.append((traced.saved_bytes, sum(p.numel() for p in model.parameters())))
    return out


SPLITS = [
    (5, 2, None, dict(pipeline_model_parallel_layout="Et|ttttL")),
    (7, 2, None, dict(num_layers_in_first_pipeline_stage=3)),
    (6, 2, 2, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    (6, 3, 2, dict(pipeline_model_parallel_layout="Ett|t|t|t|t|L")),
    (8, 2, 2, dict(num_layers_in_first_pipeline_stage=2)),
    # Multi-token prediction: Core builds the decoder's final norm with the last decoder layer (here on stage 1's
    # second chunk, the depths on stage 2's), the depths in the last chunk of the stage the layout puts them on.
    (6, 3, 2, dict(pipeline_model_parallel_layout="Ett|t|t|t|t|mL", mtp_num_layers=1)),
    (5, 2, None, dict(pipeline_model_parallel_layout="Et|ttttmmL", mtp_num_layers=2)),
    (8, 2, 2, dict(num_layers_in_first_pipeline_stage=2, mtp_num_layers=1)),
]


@pytest.mark.parametrize("layers, pp, vpp, split", SPLITS, ids=["layout", "first", "accounted", "layout-vpp", "first-vpp",
                                                              "mtp-layout-vpp", "mtp-layout", "mtp-first-vpp"])
def test_each_stage_holds_what_cores_chunks_save_times_their_forwards(layers, pp, vpp, split):
    cfg = _config(layers, pp, vpp, **split)
    est = memory.estimate(cfg, device="cpu", num_microbatches=NUM_MICROBATCHES, attention="fused",
                          transformer_impl="local")
    prepared = memory.prepare(cfg, data_parallel_size=None, num_microbatches=NUM_MICROBATCHES)
    stages = memory.candidate_stages(prepared.provider)
    assert sorted(est.stage_peaks) == stages
    for stage in stages:
        one = memory._estimate_stage(prepared, stage, attention="fused", impl="local", device="cpu")
        chunks = _core_chunks(prepared, stage)
        forwards = pipeline.chunk_forwards(pp=pp, vpp=vpp, num_microbatches=NUM_MICROBATCHES, stage=stage)
        expected = sum(f * saved for f, (saved, _) in zip(forwards, chunks))
        assert sum(c.bytes for c in one.components if c.kind == ACTIVATIONS) == expected, stage
        weights = sum(c.bytes for c in one.components if c.name.startswith("weights"))
        assert weights == sum(params for _, params in chunks) * 4, stage  # fp32
    assert est.stage == max(est.stage_peaks, key=est.stage_peaks.get)
