"""The LoRA-A autograd functions under sequence parallelism, on 2 ranks (TP=2), against Megatron.

The baseline is Bridge's path for a column-parallel base layer: ``gather_from_sequence_parallel_region``,
then LoRA-A as a ColumnParallelLinear without SP (``linear_with_grad_accumulation_and_async_allreduce``),
then ``gather_from_tensor_model_parallel_region`` (gather_output). Downstream, LoRA-B's input region
(``copy_to_tensor_model_parallel_region``) all-reduces the grad, so the grad reaching LoRA-A's output is
replicated, as the shard-local function requires.

Every rank computes its errors, all-reduces them (MAX) over the TP group, and asserts on the reduced
value, so that both ranks pass or fail together and their collectives stay paired.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bridge_ext.levers.lora_input import sp_lora
from tests.support.dist_checks import all_ranks_equal as _all_ranks_equal
from tests.support.dist_checks import max_over_ranks as _max_over_ranks
from tests.support.dist_checks import rel_err as _rel_err

TP = 2


# ---------------------------------------------------------------------------------------------- helpers


def _global_problem(seed: int, s: int, b: int, h: int, r: int, dtype=torch.float32):
    """Global x [s, b, h], LoRA-A weight A [r, h], upstream grad G [s, b, r]; identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, h, generator=gen, dtype=torch.float64).to(dtype)
    a = torch.randn(r, h, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(s, b, r, generator=gen, dtype=torch.float64).to(dtype)
    return x, a, g


def _rank_slice(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    return tensor.chunk(group.size(), dim=dim)[group.rank()]


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(True)


def _local_leaves(x, a, group):
    """This rank's sequence shard x_k and weight shard A_k, as fresh leaves."""
    return _leaf(_rank_slice(x, 0, group)), _leaf(_rank_slice(a, 0, group))


def _baseline(x_local, weight, group, fusion=False):
    """Bridge's LoRA-A under SP: gather x, ColumnParallelLinear matmul without SP, gather the rank dim."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    total = gather_from_sequence_parallel_region(x_local, group=group)
    partial = linear_with_grad_accumulation_and_async_allreduce(
        total, weight, None, fusion, allreduce_dgrad=False, sequence_parallel=False, tp_group=group
    )
    return gather_from_tensor_model_parallel_region(partial, group=group)


def _lora_b_loss(y, g, group):
    """A loss identical on both ranks behind LoRA-B's input region (its backward all-reduces the grad)."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return (copy_to_tensor_model_parallel_region(y, group=group) * g).sum()


def _run(strategy, x, a, g, group, fusion=False, weight=None):
    """Forward and backward of one strategy ("baseline" or one of STRATEGIES); returns (y, x_k, A_k)."""
    x_local, a_local = _local_leaves(x, a, group)
    if weight is not None:
        a_local = weight
    if strategy == "baseline":
        y = _baseline(x_local, a_local, group, fusion)
    else:
        y = sp_lora.lora_a_output(strategy, x_local, a_local, group, gradient_accumulation_fusion=fusion)
    _lora_b_loss(y, g, group).backward()
    return y.detach(), x_local, a_local


# ------------------------------------------------------------------------------------------ parity


def test_regather_is_bitwise_equal_to_the_baseline_in_fp32(tp2):
    x, a, g = _global_problem(seed=11, s=16, b=3, h=64, r=16)
    y_ref, x_ref, a_ref = _run("baseline", x, a, g, tp2)
    y, x_k, a_k = _run(sp_lora.REGATHER, x, a, g, tp2)

    assert _all_ranks_equal(y, y_ref, tp2), "outputs differ"
    assert _all_ranks_equal(x_k.grad, x_ref.grad, tp2), "input grads differ"
    assert _all_ranks_equal(a_k.grad, a_ref.grad, tp2), "weight grads differ"


def test_regather_partial_output_is_the_column_parallel_shard(tp2):
    x, a, _ = _global_problem(seed=12, s=8, b=2, h=32, r=8)
    x_local, a_local = _local_leaves(x, a, tp2)
    partial = sp_lora.regather_lora_a(x_local, a_local, tp2)
    assert partial.shape == (8, 2, 8 // TP)
    assert _rel_err(partial, _rank_slice(x @ a.t(), -1, tp2), tp2) <= 1e-6


def test_shard_local_matches_the_baseline_in_fp32(tp2):
    x, a, g = _global_problem(seed=13, s=16, b=3, h=64, r=16)
    y_ref, x_ref, a_ref = _run("baseline", x, a, g, tp2)
    y, x_k, a_k = _run(sp_lora.SHARD_LOCAL, x, a, g, tp2)

    assert y.shape == (16, 3, 16)
    assert _rel_err(y, y_ref, tp2) <= 1e-6
    assert _rel_err(x_k.grad, x_ref.grad, tp2) <= 1e-6
    assert _rel_err(a_k.grad, a_ref.grad, tp2) <= 1e-6


def test_unknown_strategy_is_refused(tp2):
    x, a, _ = _global_problem(seed=14, s=4, b=1, h=8, r=4)
    x_local, a_local = _local_leaves(x, a, tp2)
    with pytest.raises(ValueError, match="unknown LoRA-A strategy"):
        sp_lora.lora_a_output("gather_everything", x_local, a_local, tp2)


# ------------------------------------------------------------------- main_grad (gradient accumulation fusion)


def _weight_with_main_grad(a, group, flag: bool):
    weight = _leaf(_rank_slice(a, 0, group))
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    if flag:
        weight.grad_added_to_main_grad = False
        weight.zero_out_wgrad = True
    return weight


def _two_microbatches(strategy, a, group, fusion, weight=None):
    """Run two microbatches with one weight; returns the per-microbatch (x_k, A_k) leaves."""
    runs = []
    for seed in (21, 22):
        x, _, g = _global_problem(seed, s=8, b=2, h=32, r=8)
        runs.append(_run(strategy, x, a, g, group, fusion=fusion, weight=weight)[1:])
    return runs


def _wgrad_error(strategy, got, want, group) -> float:
    """Regather promises bitwise equality; shard-local sums in another order."""
    if strategy == sp_lora.REGATHER:
        return 0.0 if _all_ranks_equal(got, want, group) else float("inf")
    return _rel_err(got, want, group)


@pytest.mark.parametrize("strategy", sp_lora.STRATEGIES)
def test_main_grad_accumulates_two_microbatches(tp2, strategy):
    _, a, _ = _global_problem(seed=20, s=8, b=2, h=32, r=8)
    reference = _two_microbatches("baseline", a, tp2, fusion=False)
    weight = _weight_with_main_grad(a, tp2, flag=True)
    ours = _two_microbatches(strategy, a, tp2, fusion=True, weight=weight)

    want = reference[0][1].grad + reference[1][1].grad
    assert _wgrad_error(strategy, weight.main_grad, want, tp2) <= 1e-6
    assert _max_over_ranks(0.0 if weight.grad_added_to_main_grad is True else 1.0, tp2) == 0.0
    # The dummy grad returned for DDP's hooks: zeros (zero_out_wgrad), accumulated twice.
    assert weight.grad is not None and weight.grad.shape == weight.shape
    assert _max_over_ranks(weight.grad.abs().max().item(), tp2) == 0.0
    for (x_k, _), (x_ref, _) in zip(ours, reference):
        assert _rel_err(x_k.grad, x_ref.grad, tp2) <= 1e-6


def test_regather_main_grad_without_the_fused_kernel_module(tp2, monkeypatch):
    """Without Apex's kernels the fp32 wgrad is added to main_grad directly, with the same result."""
    monkeypatch.setattr(sp_lora, "_fused_wgrad_kernels", lambda: None)
    _, a, _ = _global_problem(seed=25, s=8, b=2, h=32, r=8)
    reference = _two_microbatches("baseline", a, tp2, fusion=False)
    weight = _weight_with_main_grad(a, tp2, flag=True)
    _two_microbatches(sp_lora.REGATHER, a, tp2, fusion=True, weight=weight)

    assert _all_ranks_equal(weight.main_grad, reference[0][1].grad + reference[1][1].grad, tp2)
    assert _max_over_ranks(0.0 if weight.grad_added_to_main_grad is True else 1.0, tp2) == 0.0


@pytest.mark.parametrize("strategy", sp_lora.STRATEGIES)
def test_main_grad_without_the_ddp_flag_returns_no_weight_grad(tp2, strategy):
    _, a, _ = _global_problem(seed=30, s=8, b=2, h=32, r=8)
    reference = _two_microbatches("baseline", a, tp2, fusion=False)
    weight = _weight_with_main_grad(a, tp2, flag=False)
    _two_microbatches(strategy, a, tp2, fusion=True, weight=weight)

    want = reference[0][1].grad + reference[1][1].grad
    assert _max_over_ranks(0.0 if weight.grad is None else 1.0, tp2) == 0.0
    assert not hasattr(weight, "grad_added_to_main_grad")
    assert _wgrad_error(strategy, weight.main_grad, want, tp2) <= 1e-6


@pytest.mark.parametrize("strategy", sp_lora.STRATEGIES)
def test_fusion_without_main_grad_returns_the_plain_weight_grad(tp2, strategy):
    x, a, g = _global_problem(seed=31, s=8, b=2, h=32, r=8)
    _, _, a_ref = _run("baseline", x, a, g, tp2)
    _, _, a_k = _run(strategy, x, a, g, tp2, fusion=True)
    assert _wgrad_error(strategy, a_k.grad, a_ref.grad, tp2) <= 1e-6


# -------------------------------------------------------------------- properties vs a float64 dense reference

# Normalised max error max|got - ref| / max|ref| allowed per dtype. The reference is computed in
# float64 from the inputs already rounded to the dtype, so only the function's own rounding counts:
# a GEMM result rounded once, plus one sum of two per-rank partials (a reduce-scatter). float64 and
# float32 stay far below their bounds (about 1e-16 and 1e-7 here). bfloat16 keeps 8 significant bits:
# each rounding costs up to 2**-9 (about 2e-3) of a value, and regather's dgrad is rounded twice
# (GEMM, then the bfloat16 reduce-scatter), so 1e-2 leaves a margin over the few roundings.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}

_PROPERTY_SETTINGS = settings(
    derandomize=True,  # both ranks draw the same examples, so their collectives pair up
    database=None,
    deadline=None,
    max_examples=20,
    suppress_health_check=list(HealthCheck),  # timing-based checks could differ between ranks
    print_blob=False,
)

_shapes = st.fixed_dictionaries(
    {
        "s": st.integers(1, 8).map(lambda n: TP * n),
        "b": st.integers(1, 3),
        "h": st.integers(1, 24),
        "r": st.integers(1, 8).map(lambda n: TP * n),
        "dtype": st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
        "seed": st.integers(0, 2**16),
    }
)


def _dense_reference(x, a, g):
    """y = x A^T, dx = G A, dA = G^T x over all tokens, in float64."""
    x, a, g = x.double(), a.double(), g.double()
    return x @ a.t(), g @ a, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _assert_within_tolerance(got_and_want, dtype, group):
    errors = [_rel_err(got, want, group) for got, want in got_and_want]
    assert max(errors) <= TOLERANCE[dtype], f"{dtype}: errors (output, dgrad, wgrad) = {errors}"


@_PROPERTY_SETTINGS
@given(shape=_shapes)
def test_regather_property_against_dense_reference(tp2, shape):
    x, a, g = _global_problem(shape["seed"], shape["s"], shape["b"], shape["h"], shape["r"], shape["dtype"])
    y_ref, dx_ref, da_ref = _dense_reference(x, a, g)
    x_local, a_local = _local_leaves(x, a, tp2)

    partial = sp_lora.regather_lora_a(x_local, a_local, tp2)
    partial.backward(_rank_slice(g, -1, tp2))  # what gather_output's backward hands over

    _assert_within_tolerance(
        [
            (partial, _rank_slice(y_ref, -1, tp2)),
            (x_local.grad, _rank_slice(dx_ref, 0, tp2)),
            (a_local.grad, _rank_slice(da_ref, 0, tp2)),
        ],
        shape["dtype"],
        tp2,
    )


@_PROPERTY_SETTINGS
@given(shape=_shapes)
def test_shard_local_property_against_dense_reference(tp2, shape):
    x, a, g = _global_problem(shape["seed"], shape["s"], shape["b"], shape["h"], shape["r"], shape["dtype"])
    y_ref, dx_ref, da_ref = _dense_reference(x, a, g)
    x_local, a_local = _local_leaves(x, a, tp2)

    h = sp_lora.shard_local_lora_a(x_local, a_local, tp2)
    h.backward(g)  # replicated over the group, as the contract requires

    _assert_within_tolerance(
        [(h, y_ref), (x_local.grad, _rank_slice(dx_ref, 0, tp2)), (a_local.grad, _rank_slice(da_ref, 0, tp2))],
        shape["dtype"],
        tp2,
    )


# ------------------------------------------------------------------------------- what is retained


def _saved_by(forward):
    """Run forward under saved-tensor hooks; returns (output, [(shape, bytes) of each saved tensor])."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.numel() * tensor.element_size()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    return output, saved


@pytest.mark.parametrize("strategy", sp_lora.STRATEGIES)
def test_only_the_shard_and_the_weight_are_saved(tp2, strategy):
    s, b, h, r = 16, 2, 32, 8
    x, a, g = _global_problem(seed=40, s=s, b=b, h=h, r=r)
    x_local, a_local = _local_leaves(x, a, tp2)
    function = sp_lora.regather_lora_a if strategy == sp_lora.REGATHER else sp_lora.shard_local_lora_a
    output, saved = _saved_by(lambda: function(x_local, a_local, tp2))

    shard_bytes = x_local.numel() * x_local.element_size()
    weight_bytes = (r // TP) * h * a_local.element_size()  # the parameter shard itself, never a gathered copy
    problems = 0.0
    problems += sum(bytes_ for _, bytes_ in saved) != shard_bytes + weight_bytes
    problems += (s, b, h) in [shape for shape, _ in saved]
    problems += tuple(x_local.shape) not in [shape for shape, _ in saved]
    assert _max_over_ranks(problems, tp2) == 0.0, saved
    output.backward(_rank_slice(g, -1, tp2) if strategy == sp_lora.REGATHER else g)  # still back-propagates


def test_the_baseline_saves_the_gathered_input(tp2):
    """The measurement itself sees what Megatron's baseline retains: the [s, b, h] gathered input."""
    s, b, h, r = 16, 2, 32, 8
    x, a, _ = _global_problem(seed=41, s=s, b=b, h=h, r=r)
    x_local, a_local = _local_leaves(x, a, tp2)
    _, saved = _saved_by(lambda: _baseline(x_local, a_local, tp2))
    assert _max_over_ranks(0.0 if (s, b, h) in [shape for shape, _ in saved] else 1.0, tp2) == 0.0


# ----------------------------------------------------------------------------------- communication


@pytest.fixture
def collectives(monkeypatch):
    """Records (collective, output shape, input shape) of every torch.distributed call of interest."""
    calls = []
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather"):
        original = getattr(dist, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            shapes = tuple(tuple(arg.shape) for arg in args[:2] if isinstance(arg, torch.Tensor))
            calls.append((_name, *shapes))
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, recording)
    return calls


def test_collectives_of_each_function(tp2, collectives):
    s, b, h, r = 8, 2, 16, 4
    x, a, g = _global_problem(seed=50, s=s, b=b, h=h, r=r)
    shard = (s // TP, b, h)

    x_local, a_local = _local_leaves(x, a, tp2)
    y = sp_lora.regather_lora_a(x_local, a_local, tp2)
    regather_forward = list(collectives)
    y.backward(_rank_slice(g, -1, tp2))
    regather_backward = collectives[len(regather_forward) :]
    collectives.clear()

    x_local, a_local = _local_leaves(x, a, tp2)
    out = sp_lora.shard_local_lora_a(x_local, a_local, tp2)
    shard_local_forward = list(collectives)
    out.backward(g)
    shard_local_backward = collectives[len(shard_local_forward) :]

    expected = (
        [("all_gather_into_tensor", (s, b, h), shard)],
        [("all_gather_into_tensor", (s, b, h), shard), ("reduce_scatter_tensor", shard, (s, b, h))],
        [("all_gather_into_tensor", (r, h), (r // TP, h)), ("all_gather_into_tensor", (s, b, r), (s // TP, b, r))],
        [("all_gather_into_tensor", (r, h), (r // TP, h)), ("reduce_scatter_tensor", (r // TP, h), (r, h))],
    )
    got = (regather_forward, regather_backward, shard_local_forward, shard_local_backward)
    assert _max_over_ranks(0.0 if got == expected else 1.0, tp2) == 0.0, got
