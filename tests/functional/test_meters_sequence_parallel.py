"""SavedActivationMeter and CollectiveCounter on a real Megatron Core sequence-parallel layer.

A ColumnParallelLinear with sequence parallelism receives the local sequence shard
[s/t, b, h], all-gathers it to [s, b, h] for the matmul and saves only the shard for backward;
backward all-gathers the shard again (for the weight gradient) and reduce-scatters the input
gradient [s, b, h]. Sizes below are computed from these shapes; fp32 is 4 bytes per element.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_bridge_ext.measure import ROOT, CollectiveCounter, SavedActivationMeter

pytestmark = [
    pytest.mark.functional,
    pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning"),
]

TP = 2
SEQ, BATCH, HIDDEN, OUT = 8, 2, 6, 4
FP32 = 4


def _sequence_parallel_projection(tp_group) -> nn.ModuleDict:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=TP,
        sequence_parallel=True,
        use_cpu_initialization=True,
    )
    projection = ColumnParallelLinear(
        HIDDEN,
        OUT,
        config=config,
        init_method=nn.init.xavier_normal_,
        bias=True,
        gather_output=False,
        tp_group=tp_group,
    )
    return nn.ModuleDict({"proj": projection})


def _local_shard() -> torch.Tensor:
    return torch.randn(SEQ // TP, BATCH, HIDDEN, requires_grad=True)


def test_column_parallel_sequence_parallel_saves_only_the_local_shard(tp2):
    model = _sequence_parallel_projection(tp2)
    with SavedActivationMeter(model) as meter:
        output, _ = model["proj"](_local_shard())
    assert output.shape == (SEQ, BATCH, OUT // TP)
    result = meter.result()
    assert result.total_bytes == SEQ // TP * BATCH * HIDDEN * FP32
    assert result.by_module == {"proj": SEQ // TP * BATCH * HIDDEN * FP32}
    assert result.parameter_bytes == OUT // TP * HIDDEN * FP32  # the local weight shard


def test_column_parallel_sequence_parallel_collectives(tp2):
    model = _sequence_parallel_projection(tp2)
    with CollectiveCounter(model) as counter:
        output, _ = model["proj"](_local_shard())
        output.sum().backward()
    full = SEQ * BATCH * HIDDEN
    forward = [(call.kind, call.elements, call.module) for call in counter.select(phase="forward")]
    backward = sorted((call.kind, call.elements) for call in counter.select(phase="backward"))
    assert forward == [("all_gather", full, "proj")]
    assert backward == [("all_gather", full), ("reduce_scatter", full)]
    assert {call.module for call in counter.select(phase="backward")} == {ROOT}
    assert counter.elements_by_kind() == {"all_gather": 2 * full, "reduce_scatter": full}
    assert counter.max_elements() == full
    assert all(call.dtype == torch.float32 for call in counter.calls)


def test_megatron_collective_aliases_are_wrapped_then_restored(tp2):
    from megatron.core import utils
    from megatron.core.tensor_parallel import layers, mappings

    aliases = [
        (layers, "dist_all_gather_func"),
        (layers, "dist_reduce_scatter_func"),
        (mappings, "dist_all_gather_func"),
        (mappings, "dist_reduce_scatter_func"),
        (utils, "dist_all_gather_func"),
    ]
    originals = [getattr(module, name) for module, name in aliases]
    with CollectiveCounter():
        wrapped = [getattr(module, name) for module, name in aliases]
        assert all(now is not before for now, before in zip(wrapped, originals))
    assert [getattr(module, name) for module, name in aliases] == originals
