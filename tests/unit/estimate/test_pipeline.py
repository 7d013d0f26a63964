"""The estimate's pipeline split against Megatron Core's own: layers per stage and chunk, schedule forwards per chunk.

Core's ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` (``transformer_block.py``,
``transformer_layer.py``) are called on a finalized ``TransformerConfig`` for every pipeline rank and virtual stage,
with Core's parallel state set to that rank (a layout reads it), and the layers they give each chunk are compared
with :func:`megatron_bridge_ext.estimate.pipeline.stage_chunks`.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_bridge_ext.estimate import pipeline

pytestmark = [pytest.mark.unit]


def _config(num_layers: int, pp: int, vpp=None, **split):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=2,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                             pipeline_dtype=torch.float32, **split)


@contextlib.contextmanager
def _core_rank(pp: int, rank: int, vpp):
    from megatron.core import parallel_state as ps

    saved = (ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE, ps._MPU_PIPELINE_MODEL_PARALLEL_RANK,
             ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE)
    ps.set_pipeline_model_parallel_world_size(pp)
    ps.set_pipeline_model_parallel_rank(rank)
    ps.set_virtual_pipeline_model_parallel_world_size(vpp)
    try:
        yield
    finally:
        (ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE, ps._MPU_PIPELINE_MODEL_PARALLEL_RANK,
         ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE) = saved


def core_chunks(config) -> list[list[list[int]]]:
    """The global layer numbers of each [stage][chunk] by Core's functions."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    out = []
    for rank in range(pp):
        with _core_rank(pp, rank, vpp):
            stages = []
            for chunk in range(vpp or 1):
                vp_stage = chunk if vpp else None
                offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
                stages.append(list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage,
                                                                                  pp_rank=rank))))
            out.append(stages)
    return out


SPLITS = [
    (8, 2, None, {}),
    (8, 2, 2, {}),
    (126, 8, 2, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    (126, 16, None, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    (94, 4, None, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    (23, 4, None, dict(account_for_embedding_in_pipeline_split=True)),
    (13, 2, 7, dict(account_for_loss_in_pipeline_split=True)),
    (10, 4, None, dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)),
    (14, 4, 2, dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=4)),
    (9, 3, None, dict(num_layers_in_last_pipeline_stage=1)),
    (14, 3, 2, dict(num_layers_in_first_pipeline_stage=2)),
    (7, 2, None, dict(num_layers_in_first_pipeline_stage=3)),
    (61, 16, None, dict(pipeline_model_parallel_layout="Etttt|" + "tttt|" * 14 + "tL")),
    (61, 8, 2, dict(pipeline_model_parallel_layout=[["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * 14
                    + [["decoder", "loss"]])),
    (5, 2, None, dict(pipeline_model_parallel_layout="Et|ttttL")),
    (6, 2, 3, dict(pipeline_model_parallel_layout="E|t|tt|t|t|tL")),
    (6, 3, 2, dict(pipeline_model_parallel_layout="Ettt||t|t||tL")),
]


@pytest.mark.parametrize("num_layers, pp, vpp, split", SPLITS)
def test_layers_of_each_stage_and_chunk_are_cores(num_layers, pp, vpp, split):
    config = _config(num_layers, pp, vpp, **split)
    assert pipeline.split_problems(config) == []
    ours = [[list(chunk.layers) for chunk in stage] for stage in pipeline.stage_chunks(config)]
    assert ours == core_chunks(config)
    assert sorted(layer for stage in ours for chunk in stage for layer in chunk) == list(range(num_layers))


@pytest.mark.parametrize("num_layers, pp, vpp, split", SPLITS)
def test_embedding_and_loss_are_where_bridge_builds_them(num_layers, pp, vpp, split):
    """Bridge's ``provide``: ``pre_process`` on the first chunk of the first stage, ``post_process`` on the last chunk
    of the last stage (``is_vp_first_stage`` / ``is_vp_last_stage`` and the pipeline rank)."""
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage

    config = _config(num_layers, pp, vpp, **split)
    chunks = pipeline.stage_chunks(config)
    vpp = config.virtual_pipeline_model_parallel_size
    for rank, stage in enumerate(chunks):
        for v, chunk in enumerate(stage):
            vp_stage = v if vpp else None
            assert chunk.embedding == (rank == 0 and is_vp_first_stage(vp_stage, vpp))
            assert chunk.loss == (rank == pp - 1 and is_vp_last_stage(vp_stage, vpp))


REFUSED = [
    (10, 4, None, {}, "model.pipeline_model_parallel_size"),
    (16, 4, 3, {}, "model.virtual_pipeline_model_parallel_size"),
    (125, 8, None, dict(account_for_embedding_in_pipeline_split=True), "model.pipeline_model_parallel_size"),
    (126, 8, 3, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     "model.virtual_pipeline_model_parallel_size"),
    (10, 4, None, dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=1),
     "model.num_layers_in_first_pipeline_stage"),
    (12, 3, 2, dict(num_layers_in_first_pipeline_stage=3), "model.num_layers_in_first_pipeline_stage"),
    (5, 2, None, dict(pipeline_model_parallel_layout="Ett|ttL"), pipeline.LAYOUT),
    (5, 2, None, dict(pipeline_model_parallel_layout="tEt|tttL"), pipeline.LAYOUT),
    (5, 2, None, dict(pipeline_model_parallel_layout="Ett|t|ttL"), pipeline.LAYOUT),
    (5, 2, None, dict(pipeline_model_parallel_layout="Ett|ttt", ), pipeline.LAYOUT),
]


@pytest.mark.parametrize("num_layers, pp, vpp, split, setting", REFUSED)
def test_splits_core_refuses_are_named(num_layers, pp, vpp, split, setting):
    """Each split is one Core refuses, in its ``TransformerConfig`` or when it builds the stages; the finding names
    the setting."""
    from types import SimpleNamespace

    with pytest.raises((ValueError, AssertionError)):
        core_chunks(_config(num_layers, pp, vpp, **split))
    model = SimpleNamespace(num_layers=num_layers, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp, **split)
    problems = pipeline.split_problems(model)
    assert problems and problems[0].setting == setting


def test_a_layout_with_a_conflicting_split_field_is_named():
    from types import SimpleNamespace

    model = SimpleNamespace(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
                            pipeline_model_parallel_layout="Ett|ttL", account_for_loss_in_pipeline_split=True)
    problems = pipeline.split_problems(model)
    assert [p.setting for p in problems] == [pipeline.LAYOUT]
    assert "account_for_loss_in_pipeline_split" in problems[0].message


@pytest.mark.parametrize("pp, vpp, num_microbatches, group", [(4, 2, 8, None), (4, 3, 16, None), (8, 2, 64, None),
                                                               (4, 2, 5, None), (2, 4, 3, None), (4, 2, 16, 6)])
def test_forwards_per_chunk_follow_cores_schedule_table(pp, vpp, num_microbatches, group):
    """The chunks of the first ``warmup + 1`` virtual microbatches, read from Core's ``get_schedule_table``, the warm-up
    count from Core's ``get_pp_rank_microbatches`` (tests/unit/estimate/test_memory_schedule.py)."""
    from collections import Counter

    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    from tests.unit.estimate.test_memory_schedule import core_forwards_before_first_backward

    group = group or pp
    table = get_schedule_table(num_microbatches, vpp, group)
    for stage in range(pp):
        alive = core_forwards_before_first_backward(pp=pp, vpp=vpp, num_microbatches=num_microbatches, stage=stage,
                                                    group=group)
        counts = Counter(chunk for _, chunk in table[:alive])
        ours = pipeline.chunk_forwards(pp=pp, vpp=vpp, num_microbatches=num_microbatches, stage=stage,
                                       group_size=None if group == pp else group)
        assert ours == [counts[chunk] for chunk in range(vpp)]


def test_the_last_stages_loss_chunk_holds_fewer_forwards_than_its_first():
    """Llama 3.1 405B's PP 8 x VPP 2: the last stage runs 8 forwards of chunk 0 before its first chunk-1 forward."""
    assert pipeline.chunk_forwards(pp=8, vpp=2, num_microbatches=64, stage=7) == [8, 1]


def test_candidate_stages_are_the_first_of_each_kind():
    config = _config(61, 16, None, pipeline_model_parallel_layout="Etttt|" + "tttt|" * 14 + "tL")
    assert pipeline.candidate_stages(config, [0] * 61) == [0, 1, 15]
    mixed = [0] * 3 + [1] * 58  # DeepSeek-V3's three dense layers first
    assert pipeline.candidate_stages(config, mixed) == [0, 1, 15]
    assert pipeline.candidate_stages(config, list(range(61))) == list(range(16))


UNEVEN = [
    (92, 8, None, {}),  # GLM-4.5's decoder at its H100 recipes' PP
    (45, 8, None, {}),  # Step-3.5-Flash's at its recipe's PP
    (125, 8, None, dict(account_for_embedding_in_pipeline_split=True)),
    (124, 8, 2, dict(account_for_embedding_in_pipeline_split=True)),
]


@pytest.mark.parametrize("num_layers, pp, vpp, split", UNEVEN)
def test_layers_pp_does_not_divide_cite_the_line_of_core_that_refuses_them(num_layers, pp, vpp, split):
    """The refusal names the file and lines where Core raises it (its ``TransformerConfig`` with the embedding or
    the loss counted, else the even split when a stage is built), read from Core's own traceback."""
    from types import SimpleNamespace

    from tests.support.cited import cites, raised_at

    file, line = raised_at(lambda: core_chunks(_config(num_layers, pp, vpp, **split)), ValueError, AssertionError)
    model = SimpleNamespace(num_layers=num_layers, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp, **split)
    [problem] = pipeline.split_problems(model)
    assert problem.setting == "model.pipeline_model_parallel_size"
    assert cites(problem.message, file, line), (file, line, problem.message)
