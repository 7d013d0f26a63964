"""The collective counter on a one-rank gloo group: each collective sized by its convention, phase and module recorded."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_bridge_ext.measure import ROOT, CollectiveCounter

pytestmark = [
    pytest.mark.unit,
    # torch marks all_gather_into_tensor & co. deprecated; Megatron Core still calls them.
    pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning"),
]


# --------------------------------------------------------------------------------------------
# CollectiveCounter (one-rank gloo group)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_each_collective_is_sized_by_its_convention(one_rank):
    t = torch.ones(6)
    with CollectiveCounter() as counter:
        dist.all_gather_into_tensor(torch.empty(6), t)
        dist.all_gather([torch.empty(6)], t)
        dist.reduce_scatter_tensor(torch.empty(6), torch.ones(6))
        dist.all_reduce(torch.ones(5))
        dist.all_to_all_single(torch.empty(4), torch.ones(4))
        dist.all_gather_single(torch.empty(2), torch.ones(2))
        dist.reduce_scatter_single(torch.empty(1), torch.ones(1))
        dist.broadcast(torch.ones(3, dtype=torch.bfloat16), src=0)
    kinds = [(call.kind, call.elements, call.function) for call in counter.calls]
    assert kinds == [
        ("all_gather", 6, "all_gather_into_tensor"),
        ("all_gather", 6, "all_gather"),
        ("reduce_scatter", 6, "reduce_scatter_tensor"),
        ("all_reduce", 5, "all_reduce"),
        ("all_to_all", 4, "all_to_all_single"),
        ("all_gather", 2, "all_gather_single"),
        ("reduce_scatter", 1, "reduce_scatter_single"),
        ("broadcast", 3, "broadcast"),
    ]
    assert counter.calls[-1].dtype == torch.bfloat16
    assert counter.calls[-1].nbytes == 3 * 2
    assert counter.elements_by_kind() == {
        "all_gather": 6 + 6 + 2,
        "reduce_scatter": 6 + 1,
        "all_reduce": 5,
        "all_to_all": 4,
        "broadcast": 3,
    }
    assert counter.max_elements() == 6
    assert counter.max_elements("all_reduce") == 5
    assert counter.total_elements() == 14 + 7 + 5 + 4 + 3


def test_keyword_arguments_are_sized(one_rank):
    with CollectiveCounter() as counter:
        dist.all_gather_into_tensor(input_tensor=torch.ones(2), output_tensor=torch.empty(2))
        dist.reduce_scatter_tensor(output=torch.empty(7), input=torch.ones(7))
    assert [call.elements for call in counter.calls] == [2, 7]


def test_private_aliases_that_call_public_functions_count_once(one_rank):
    with CollectiveCounter() as counter:
        dist._all_gather_base(torch.empty(4), torch.ones(4))
        dist._reduce_scatter_base(torch.empty(4), torch.ones(4))
    assert [(call.kind, call.function) for call in counter.calls] == [
        ("all_gather", "_all_gather_base"),
        ("reduce_scatter", "_reduce_scatter_base"),
    ]


@pytest.fixture
def alias_module():
    """A module binding collectives at import, as Megatron Core does."""
    module = types.ModuleType("measure_alias_probe")
    module.dist_all_gather_func = dist.all_gather_into_tensor
    module.dist_reduce_scatter_func = dist.reduce_scatter_tensor
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_names_bound_at_import_are_wrapped_and_restored(one_rank, alias_module):
    original = alias_module.dist_all_gather_func
    with CollectiveCounter(alias_prefixes=("measure_alias_probe",)) as counter:
        assert alias_module.dist_all_gather_func is not original
        alias_module.dist_all_gather_func(torch.empty(3), torch.ones(3))
        alias_module.dist_reduce_scatter_func(torch.empty(3), torch.ones(3))
    assert alias_module.dist_all_gather_func is original
    assert [call.kind for call in counter.calls] == ["all_gather", "reduce_scatter"]


def test_everything_is_restored_on_exit_and_late_bound_wrappers_forward(one_rank):
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor")}
    with CollectiveCounter() as counter:
        bound_inside = dist.all_reduce
    for name, function in originals.items():
        assert getattr(dist, name) is function
        assert getattr(dist.distributed_c10d, name) is function
    t = torch.ones(2)
    bound_inside(t)
    torch.testing.assert_close(t, torch.ones(2))
    assert counter.calls == []


def test_nested_counters_both_count(one_rank):
    with CollectiveCounter() as outer:
        with CollectiveCounter() as inner:
            dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(3))
    assert [call.elements for call in inner.calls] == [2]
    assert [call.elements for call in outer.calls] == [2, 3]


class AllReduceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x.detach().clone())
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class Reducing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return AllReduceInBackward.apply(x)


def test_phase_and_module_are_recorded(one_rank):
    model = nn.ModuleDict({"reducing": Reducing()})
    x = torch.ones(5, requires_grad=True)
    with CollectiveCounter(model) as counter:
        model["reducing"](x).sum().backward()
    assert [(call.phase, call.module) for call in counter.calls] == [
        ("forward", "reducing"),
        ("backward", ROOT),
    ]
    assert counter.elements_by_kind("forward") == {"all_reduce": 5}
    assert counter.elements_by_module() == {"reducing": {"all_reduce": 5}, ROOT: {"all_reduce": 5}}


def test_counter_as_dict_is_json_serialisable(one_rank):
    with CollectiveCounter() as counter:
        dist.all_reduce(torch.ones(2, dtype=torch.float16))
    data = json.loads(json.dumps(counter.as_dict()))
    assert data["calls"] == [
        {
            "kind": "all_reduce",
            "elements": 2,
            "dtype": "float16",
            "phase": "forward",
            "module": ROOT,
            "function": "all_reduce",
        }
    ]
    assert data["elements_by_phase"] == {"forward": {"all_reduce": 2}, "backward": {}}
