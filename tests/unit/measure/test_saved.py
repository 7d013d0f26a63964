"""The saved-activation meter on single-process CPU models.

Expected sizes are computed by hand from shapes: fp32 is 4 bytes per element.
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_bridge_ext.measure import ROOT, SavedActivationMeter, default_category

pytestmark = [
    pytest.mark.unit,
    # torch marks all_gather_into_tensor & co. deprecated; Megatron Core still calls them.
    pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning"),
]

FP32 = 4


# --------------------------------------------------------------------------------------------
# SavedActivationMeter
# --------------------------------------------------------------------------------------------


def test_linear_saves_its_input_and_weight_counts_as_parameter():
    n, d_in, d_out = 4, 3, 5
    linear = nn.Linear(d_in, d_out)
    x = torch.randn(n, d_in, requires_grad=True)
    with SavedActivationMeter(linear) as meter:
        linear(x)
    result = meter.result()
    assert result.total_bytes == n * d_in * FP32
    assert result.by_module == {ROOT: n * d_in * FP32}
    # addmm saves weight.t(), a view of the weight: the whole weight storage, bias not needed.
    assert result.parameter_bytes == d_out * d_in * FP32


def test_layer_norm_saves_input_mean_and_rstd():
    # CPU native_layer_norm saves input [B, S, H], mean [B, S, 1] and rstd [B, S, 1] (fp32 for
    # fp32 input), plus weight and bias (parameters).
    b, s, h = 2, 3, 8
    norm = nn.LayerNorm(h)
    x = torch.randn(b, s, h, requires_grad=True)
    with SavedActivationMeter(norm) as meter:
        norm(x)
    result = meter.result()
    assert result.total_bytes == b * s * h * FP32 + 2 * b * s * FP32
    assert result.parameter_bytes == 2 * h * FP32


def test_layer_norm_without_model_counts_weight_and_bias_as_activations():
    b, s, h = 2, 3, 8
    norm = nn.LayerNorm(h)
    with SavedActivationMeter() as meter:
        norm(torch.randn(b, s, h))
    assert meter.result().total_bytes == b * s * h * FP32 + 2 * b * s * FP32 + 2 * h * FP32
    assert meter.result().parameter_bytes == 0


def test_fake_tensors_count_each_storage_by_its_own_size():
    # Under FakeTensorMode no storage has data (every data pointer is 0); each is still its own
    # storage. exp saves its output e; mul saves its inputs, a view of b (b's whole storage) and e.
    from torch._subclasses.fake_tensor import FakeTensorMode

    a_rows, b_rows, d = 5, 7, 3
    with FakeTensorMode():
        a = torch.empty(a_rows, d, requires_grad=True)
        b = torch.empty(b_rows, d, requires_grad=True)
        with SavedActivationMeter() as meter:
            e = a.exp()
            b[:a_rows].mul(e)
    assert meter.result().total_bytes == (a_rows * d + b_rows * d) * FP32


def test_fake_views_of_one_storage_count_once():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.ModuleDict({"product": TwoViewsProduct()})
    with FakeTensorMode(allow_non_fake_inputs=True):
        base = torch.empty(10, requires_grad=True)
        with SavedActivationMeter(model) as meter:
            model["product"](base)
    assert meter.result().total_bytes == 10 * FP32


class TwoViewsProduct(nn.Module):
    """Multiplies two disjoint views of one leaf: mul saves both views, one storage."""

    def forward(self, base: torch.Tensor) -> torch.Tensor:
        return base[:2] * base[2:4]


def test_views_of_one_storage_count_the_whole_storage_once():
    model = nn.ModuleDict({"product": TwoViewsProduct()})
    base = torch.randn(10, requires_grad=True)
    with SavedActivationMeter(model) as meter:
        model["product"](base)
    # Not 2 * 2 * 4 (view sizes) and not 2 * 40 (storage per view): the 40-byte storage once,
    # in the total and in the module that saved it twice.
    assert meter.result().total_bytes == 10 * FP32
    assert meter.result().by_module == {"product": 10 * FP32}


class SharedInput(nn.Module):
    """Two linears reading the same input, like a base layer and its LoRA-A."""

    def __init__(self, d_in: int = 3):
        super().__init__()
        self.first = nn.Linear(d_in, 5)
        self.second = nn.Linear(d_in, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x).sum() + self.second(x).sum()


def test_storage_saved_by_two_modules_counts_once_in_total_and_in_each_module():
    n, d_in = 4, 3
    model = SharedInput(d_in)
    categories = {"first": "cat_a", "second": "cat_b"}
    x = torch.randn(n, d_in)
    with SavedActivationMeter(model, classifier=lambda name: categories.get(name, "rest")) as meter:
        model(x)
    result = meter.result()
    x_bytes = n * d_in * FP32
    assert result.total_bytes == x_bytes
    assert result.by_module == {"first": x_bytes, "second": x_bytes}
    assert result.by_category == {"cat_a": x_bytes}
    assert result.by_category_per_module == {"cat_a": x_bytes, "cat_b": x_bytes}
    assert result.module_bytes("cat_b") == x_bytes
    assert result.module_bytes("absent") == 0
    assert result.module_categories == {"first": "cat_a", "second": "cat_b"}


class SharedAndOwnInput(SharedInput):
    def __init__(self, d_in: int = 3):
        super().__init__(d_in)
        self.third = nn.Linear(d_in, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.third(x * 2).sum()


def test_a_storage_is_a_modules_alone_only_while_no_other_module_saved_it():
    """``first`` and ``second`` share x (neither keeps it alone); ``third`` alone keeps 2 x (made outside it)."""
    n, d_in = 4, 3
    model = SharedAndOwnInput(d_in)
    with SavedActivationMeter(model) as meter:
        model(torch.randn(n, d_in))
    result = meter.result()
    x_bytes = n * d_in * FP32
    assert result.by_module == {"first": x_bytes, "second": x_bytes, "third": x_bytes}
    assert result.by_module_alone == {"first": 0, "third": x_bytes}


class Adapter(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.linear_in = nn.Linear(hidden, rank, bias=False)
        self.linear_out = nn.Linear(rank, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(self.linear_in(x))


class LoRALinear(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.to_wrap = nn.Linear(hidden, hidden)
        self.adapter = Adapter(hidden, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_wrap(x) + self.adapter(x)


class Attention(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.linear_qkv = LoRALinear(hidden, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_qkv(x)


class Layer(nn.Module):
    """Names like a Megatron Bridge LoRA layer: input_layernorm, self_attention.linear_qkv.{to_wrap,
    adapter.linear_in, adapter.linear_out}, mlp."""

    def __init__(self, hidden: int = 8, rank: int = 2):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = Attention(hidden, rank)
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.self_attention(self.input_layernorm(x)))


def test_default_categories_split_the_total_and_lora_input_shows_per_module():
    n, hidden, rank = 4, 8, 2
    model = nn.ModuleDict({"layer": Layer(hidden, rank)})
    x = torch.randn(n, hidden)
    with SavedActivationMeter(model) as meter:
        model["layer"](x)
    result = meter.result()
    norm = n * hidden * FP32 + 2 * n * FP32  # input, mean, rstd
    normed = n * hidden * FP32  # saved by to_wrap, then again by adapter.linear_in
    lora_a_out = n * rank * FP32  # saved by adapter.linear_out
    mlp_in = n * hidden * FP32
    assert result.total_bytes == norm + normed + lora_a_out + mlp_in
    assert result.by_category == {"other": norm + lora_a_out + mlp_in, "attention": normed}
    assert sum(result.by_category.values()) == result.total_bytes
    assert result.module_bytes("lora_input") == normed
    assert result.by_module["layer.self_attention.linear_qkv.adapter.linear_in"] == normed
    assert result.by_module["layer.self_attention.linear_qkv.to_wrap"] == normed


def test_default_category_rules():
    assert default_category("decoder.layers.0.self_attention.linear_qkv.adapter.linear_in") == "lora_input"
    assert default_category("decoder.layers.0.mlp.linear_fc1.adapter.linear_in") == "lora_input"
    for key in ("adapter_q", "adapter_k", "adapter_v"):  # CanonicalLoRA's split adapters
        assert default_category(f"decoder.layers.0.self_attention.linear_qkv.adapter.{key}.linear_in") == "lora_input"
        assert default_category(f"decoder.layers.0.self_attention.linear_qkv.adapter.{key}.linear_out") == "other"
    for key in ("adapter_up", "adapter_gate"):
        assert default_category(f"decoder.layers.0.mlp.linear_fc1.adapter.{key}.linear_in") == "lora_input"
    assert default_category("decoder.layers.0.mlp.linear_in") == "other"  # a linear_in outside any adapter
    assert default_category("decoder.layers.0.self_attention.core_attention") == "attention"
    assert default_category("decoder.layers.0.self_attention") == "attention"
    assert default_category("decoder.layers.0.self_attention.linear_qkv.adapter.linear_out") == "other"
    assert default_category("decoder.layers.0.mlp.linear_fc1") == "other"
    assert default_category(ROOT) == "other"


class Outer(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.inner = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).sin()  # sin saves its input, in Outer's own forward


def test_saves_go_to_the_innermost_running_module():
    n, d_in, d_out = 4, 3, 5
    model = nn.Sequential(Outer(d_in, d_out))
    x = torch.randn(n, d_in)
    with SavedActivationMeter(model) as meter:
        y = model(x)
        y.cos()  # outside every module
    assert meter.result().by_module == {
        "0.inner": n * d_in * FP32,
        "0": n * d_out * FP32,
        ROOT: n * d_out * FP32,
    }


def test_several_models_are_named_by_index():
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    with SavedActivationMeter([first, second]) as meter:
        second(first(torch.randn(2, 3, requires_grad=True)))
    assert meter.result().by_module == {"0": 2 * 3 * FP32, "1": 2 * 3 * FP32}
    # Each weight is saved because each linear's input requires grad.
    assert meter.result().parameter_bytes == 2 * 3 * 3 * FP32


def test_weight_is_not_saved_when_the_input_needs_no_grad():
    linear = nn.Linear(3, 5)
    with SavedActivationMeter(linear) as meter:
        linear(torch.randn(2, 3))
    assert meter.result().total_bytes == 2 * 3 * FP32
    assert meter.result().parameter_bytes == 0


class Failing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_a_forward_that_raises_leaves_no_stale_module():
    model = nn.ModuleDict({"failing": Failing()})
    x = torch.randn(3, requires_grad=True)
    with SavedActivationMeter(model) as meter:
        with pytest.raises(ValueError):
            model["failing"](x)
        x.sin()
    assert meter.result().by_module == {ROOT: 3 * FP32}


def test_steps_are_measured_separately_and_reset():
    n, d_in = 4, 3
    linear = nn.Linear(d_in, 2)
    with SavedActivationMeter(linear) as meter:
        linear(torch.randn(n, d_in)).sum().backward()
        first = meter.step()
        linear(torch.randn(2 * n, d_in)).sum().backward()
        second = meter.step()
    assert first.total_bytes == n * d_in * FP32
    assert second.total_bytes == 2 * n * d_in * FP32
    assert meter.steps == [first, second]
    assert meter.result().total_bytes == 0


def test_graphs_alive_together_count_each_storage():
    n, d_in = 4, 3
    linear = nn.Linear(d_in, 2)
    with SavedActivationMeter(linear) as meter:
        outputs = [linear(torch.randn(n, d_in)) for _ in range(3)]
    assert meter.result().total_bytes == 3 * n * d_in * FP32
    del outputs


def test_a_freed_storage_whose_address_is_reused_counts_again():
    # Tensors over one Python buffer get a new storage each time at the same address: the way
    # an allocator reuses a freed block, made deterministic.
    n = 16
    memory = bytearray(n * FP32)
    addresses = set()
    with SavedActivationMeter() as meter:
        for _ in range(2):
            x = torch.frombuffer(memory, dtype=torch.float32).requires_grad_()
            addresses.add(x.untyped_storage().data_ptr())
            x.sin().sum().backward()  # sin saves x; backward drops the graph
            del x  # frees the storage
    assert len(addresses) == 1
    assert meter.result().total_bytes == 2 * n * FP32


def test_saved_outputs_are_not_kept_alive_by_the_meter():
    x = torch.randn(16, requires_grad=True)
    with SavedActivationMeter():
        y = x.exp()  # exp saves its output y
        storage = weakref.ref(y.untyped_storage())
        del y
        gc.collect()
        assert storage() is None


def test_gradients_are_unchanged_by_the_meter():
    torch.manual_seed(0)
    model = Layer()
    x = torch.randn(4, 8)
    expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    with SavedActivationMeter(model):
        measured = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    for got, want in zip(measured, expected):
        assert torch.equal(got, want)


def test_saves_during_backward_recompute_are_not_counted():
    n, d_in = 4, 3
    linear = nn.Linear(d_in, 5)
    x = torch.randn(n, d_in, requires_grad=True)

    def block(inputs: torch.Tensor) -> torch.Tensor:
        return linear(inputs).sin()

    with SavedActivationMeter(linear) as meter:
        y = checkpoint(block, x, use_reentrant=True)  # forward runs without grad, saves only x
        assert meter.result().total_bytes == n * d_in * FP32
        y.sum().backward()  # recompute saves x, the weight and the new [n, 5] linear output
    assert meter.result().total_bytes == n * d_in * FP32


class _ReleasesItsOutput(nn.Module):
    """Saves ``exp``'s output, which a consumer saves too, then releases it as Megatron Core's CheckpointWithoutOutput
    discards its outputs (``untyped_storage().resize_(0)``, tensor_parallel/random.py L847-848)."""

    def forward(self, x):
        out = x.exp()  # saves its output
        kept = out.sin()  # saves the same storage
        out.untyped_storage().resize_(0)
        return kept


class _Keeper(nn.Module):
    def __init__(self):
        super().__init__()
        self.released, self.kept = _ReleasesItsOutput(), nn.Sigmoid()

    def forward(self, x):
        return self.released(x), self.kept(x)  # sigmoid saves its own output


@pytest.mark.parametrize("read_inside", [True, False])
def test_a_storage_the_forward_releases_is_not_counted(read_inside):
    n, d = 4, 8
    model, x = _Keeper(), torch.randn(n, d, requires_grad=True)
    with SavedActivationMeter(model) as meter:
        outputs = model(x)
        inside = meter.result() if read_inside else None
    result = inside if read_inside else meter.result()
    assert outputs[0].untyped_storage().nbytes() > 0  # kept's own storage: sin's output is not the released one
    assert result.total_bytes == n * d * FP32  # sigmoid's output only
    assert result.by_module["released"] == 0 and result.by_module["kept"] == n * d * FP32
    assert result.by_category == {"other": n * d * FP32}
    assert result.by_category_per_module == {"other": n * d * FP32}
    assert result.by_module_alone.get("released", 0) == 0 and result.by_module_alone["kept"] == n * d * FP32
    assert meter.result().total_bytes == n * d * FP32  # taken off once, however often it is read


def test_hooks_are_removed_on_exit():
    from torch.nn.modules import module as nn_module

    pre, post = len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)
    linear = nn.Linear(3, 3)
    with SavedActivationMeter(linear) as meter:
        linear(torch.randn(2, 3))
    linear(torch.randn(2, 3))
    assert meter.result().total_bytes == 2 * 3 * FP32
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == (pre, post)


def test_result_is_json_serialisable():
    with SavedActivationMeter(Layer()) as meter:
        Layer()(torch.randn(2, 8))
    data = json.loads(json.dumps(meter.result().as_dict()))
    assert data["total_bytes"] == meter.result().total_bytes
    assert set(data) == {
        "total_bytes",
        "by_category",
        "by_module",
        "by_module_alone",
        "by_category_per_module",
        "module_categories",
        "parameter_bytes",
    }


def test_meter_accepts_megatron_cores_ddp_wrapper_whose_buffers_attribute_is_a_list():
    # Core's DistributedDataParallel sets `self.buffers = []`, hiding nn.Module.buffers(); Bridge hands the
    # wrapper to forward_step. Real Core DDP in a fresh interpreter (Core's parallel state is process-global).
    from tests.support.fresh import run

    n, h = 3, 8
    result = run(f"""
        import tempfile

        from megatron_bridge_ext.testing import cpu_emulation

        cpu_emulation.install()
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/rendezvous", rank=0,
                                world_size=1)
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import MegatronModule
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron_bridge_ext.measure import SavedActivationMeter

        parallel_state.initialize_model_parallel()
        config = TransformerConfig(num_layers=1, hidden_size={h}, num_attention_heads=1, use_cpu_initialization=True)


        class Net(MegatronModule):
            def __init__(self):
                super().__init__(config)
                self.linear = torch.nn.Linear({h}, {h})
                self.register_buffer("scale", torch.full(({h},), 2.0))

            def forward(self, x):
                return self.linear(x) * self.scale


        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), Net())
        x = torch.randn({n}, {h}, requires_grad=True)
        with SavedActivationMeter(ddp) as meter:
            ddp(x)
        saved = meter.result()
        report(buffers_attribute=type(ddp.buffers).__name__, total=saved.total_bytes, by_module=saved.by_module,
               parameter_bytes=saved.parameter_bytes)
    """)
    assert result["buffers_attribute"] == "list"  # what made SavedActivationMeter(ddp) raise before
    assert result["total"] == n * h * FP32  # the linear's input
    assert result["by_module"] == {"module.linear": n * h * FP32}  # names relative to the wrapper
    # the linear's weight (addmm saves weight.t()) and the buffer the product saves: parameters, not activations
    assert result["parameter_bytes"] == (h * h + h) * FP32
