"""Our drop-in LoRA, DoRA and CanonicalLoRA against Megatron Bridge's on 2 ranks (TP=2, sequence parallelism).

Every comparison builds the same model, weights and batch twice: once with Bridge's class as
shipped (the baseline) and once with ours of the same kind (``megatron_bridge_ext.peft.LoRA``,
``DoRA``, ``CanonicalLoRA``) under one strategy (``variants.VARIANTS`` defines both, for the
shape's kind). ``tiny_model.apply_peft`` re-draws LoRA-B, so LoRA-A's gradient and the input
gradient through the adapters are not trivially zero. The tests for CanonicalLoRA use a SwiGLU MLP
(its up and gate adapters are the halves of the gated linear_fc1). Tests on a single Megatron Core
layer, and of the special cases of eligibility, run LoRA only: they test the strategies and rules
every kind shares.

Notation: TP size t = 2, sequence s, micro-batch b, hidden h, LoRA rank r. Eligible adapters
are those of ``linear_qkv`` and ``linear_fc1`` (column-parallel bases; CanonicalLoRA has three and
two adapters there); ``linear_proj`` and ``linear_fc2`` adapters are row-parallel and stay as Bridge
builds them.

Each rank computes its own verdicts; they are all-reduced (MAX) before asserting, so both ranks
pass or fail together (see ``tests.support.dist_checks``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_bridge_ext.measure import CollectiveCounter, SavedActivationMeter
from megatron_bridge_ext.testing import tiny_model as tm
from megatron_bridge_ext.testing.variants import VARIANTS
from tests.support.dist_checks import assert_no_problems, local_rel_err

pytestmark = [
    pytest.mark.functional,
    pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*CUDA_DEVICE_MAX_CONNECTIONS.*:UserWarning"),
]

from tests.support.lora_blocks import (  # noqa: F401  (shared with the TE-path tests)
    TP,
    STRATEGIES,
    KINDS,
    ELIGIBLE_SURFACES,
    FP32_REL_TOL,
    PEFT_LOGGER,
    S,
    B,
    H,
    OUT,
    R,
    _device,
    _shape,
    _gpt,
    _adapters,
    _adapter_names,
    _trainable,
    _loss_and_grads,
    _compare,
    _nontrivial,
    _rank_slice,
    _problem,
    _wrap,
    _block,
    _parallel_config,
    _column_parallel,
    _lora_linear,
    _run_lora_linear,
    _ddp_like_microbatches,
)


# ------------------------------------------------------------------------------------ 1a. whole model, fp32


def _trainable_per_adapter(kind: str) -> int:
    """LoRA-A and LoRA-B of every adapter, and DoRA's magnitude vector."""
    return 3 if kind == "dora" else 2


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no dropout", "dropout"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_whole_model_fp32_loss_and_every_gradient_match_bridge(tp2, strategy, kind, dropout):
    """Regather runs Bridge's GEMMs on the same data: bitwise. Shard-local sums over ranks in another order.

    Adapter dropout acts on the sequence shard in Bridge's path (before the adapter's gather) as in
    ours, so with the same seed both draw the same masks (DoRA's dropout correction included)."""
    shape = _shape(kind)
    baseline, _ = _gpt(shape, "baseline", peft_fields={"dropout": dropout})
    ours, peft = _gpt(shape, strategy, peft_fields={"dropout": dropout})
    want_loss, want = _loss_and_grads(baseline, shape)
    got_loss, got = _loss_and_grads(ours, shape)

    problems = _compare({"loss": got_loss, **got}, {"loss": want_loss, **want}, bitwise=strategy == "regather")
    problems += _nontrivial(want)
    applied = sorted(d.adapter for d in peft.report() if d.strategy == strategy)
    if applied != sorted(name for name, _ in _adapters(shape, ELIGIBLE_SURFACES)):
        problems.append(f"strategy applied to {applied}")
    if len(want) != _trainable_per_adapter(kind) * len(_adapters(shape)):  # the adapters' parameters, nothing else
        problems.append(f"trainable parameters: {sorted(want)}")
    assert_no_problems(problems, tp2)


# ------------------------------------------------------------------------------------ 1b. one adapter


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_single_column_parallel_adapter_matches_bridge(tp2, strategy):
    x, g = _problem(seed=101)
    want = _run_lora_linear(_lora_linear(_block(_column_parallel(tp2), "linear_qkv", "baseline")), x, g, tp2)
    ours = _block(_column_parallel(tp2), "linear_qkv", strategy)
    got = _run_lora_linear(_lora_linear(ours), x, g, tp2)

    problems = _compare(got, want, bitwise=strategy == "regather") + _nontrivial(want)
    if type(_lora_linear(ours).adapter.linear_in).__name__ != "SequenceParallelLoRAIn":
        problems.append("LoRA-A was not switched to the sequence-local input")
    assert_no_problems(problems, tp2)


# ------------------------------------------------------------------------ 1c. main_grad (fused wgrad accumulation)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_main_grad_accumulates_two_microbatches_like_bridge(tp2, strategy, kind):
    """Every LoRA-A and LoRA-B weight goes through the fused path in both models; DoRA's magnitude
    vector is a plain parameter, whose grad DDP adds to main_grad itself."""
    shape = _shape(kind)
    baseline, _ = _gpt(shape, "baseline", gradient_accumulation_fusion=True)
    ours, _ = _gpt(shape, strategy, gradient_accumulation_fusion=True)
    fused_baseline = _ddp_like_microbatches(baseline, shape)
    fused_ours = _ddp_like_microbatches(ours, shape)

    want = {name: p.main_grad for name, p in _trainable(baseline).items()}
    got = {name: p.main_grad for name, p in _trainable(ours).items()}
    problems = _compare(got, want, bitwise=strategy == "regather") + _nontrivial(want)
    problems += [f"{name}: the fused wgrad path was not used" for name, used in {**fused_baseline, **fused_ours}.items()
                 if not used and not name.endswith("weight_magnitude")]
    assert_no_problems(problems, tp2)


# ------------------------------------------------------------------------------------ 1d. whole model, bf16

# bfloat16 keeps 8 significant bits: unit roundoff u = 2**-8 (about 3.9e-3).
BF16_LOSS_REL_TOL = 2.0**-8
BF16_GRAD_REL_TOL = 8 * 2.0**-8
BF16_ACCURACY_RATIO = 1.25


def _fp32_reference(shape: tm.TinyGPTShape):
    return _loss_and_grads(_gpt(dataclasses.replace(shape, dtype="float32"), "baseline")[0], shape)


def _norm_rel_err(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over all named tensors together (float64)."""
    num = sum(((got[n].double() - want[n].double()) ** 2).sum() for n in want)
    den = sum((want[n].double() ** 2).sum() for n in want)
    return (num / den).sqrt().item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_whole_model_bf16_matches_bridge_within_bf16_rounding(tp2, strategy, kind):
    """bf16 whole model against Bridge's class of the same kind in bf16 and against the same model in fp32.

    Regather runs the baseline's GEMMs on the same bf16 data in the same order, so it stays
    bitwise equal in bf16 (observed: loss and every gradient identical).

    Shard-local rounds differently: LoRA-A's output is one GEMM over the whole rank dim instead of
    per-rank column blocks, its input grad is one local GEMM instead of per-rank partials summed by
    a bf16 reduce-scatter, and its weight grad is reduced in fp32. Each moves a value by about one
    bf16 rounding (u = 2**-8 relative), and the input-grad change propagates into the gradients of
    the layers below. Tolerances:

    * loss, relative: u. Observed 0 (the loss is a mean over all tokens, and LoRA-B's small scale
      damps a one-rounding change of LoRA-A's output far below a rounding of the loss).
    * every gradient vs the bf16 baseline, max|diff| / max|baseline| per tensor: 8u = 3.1e-2.
      Observed 1.0e-2 here, 0.97e-2 to 1.45e-2 over five model seeds (2.5u to 3.7u): a few
      roundings, the slack covering other seeds and machines.
    * accuracy against the fp32 model, over all gradients together (||bf16 - fp32|| / ||fp32||):
      shard-local's error at most 1.25x Bridge's own. Observed both about 1.0e-2 (2.6u), the
      ratio 0.95 to 1.03 over five seeds: shard-local is as accurate as Bridge's bf16 LoRA. (The
      per-tensor maximum is too noisy for this: its ratio ranged 0.89 to 1.30.)

    DoRA and CanonicalLoRA (three seeds each): loss 0; gradients 2.8u to 3.6u; ratio 0.97 to 1.03.
    """
    shape = _shape(kind, dtype="bfloat16")
    want_loss, want = _loss_and_grads(_gpt(shape, "baseline")[0], shape)
    got_loss, got = _loss_and_grads(_gpt(shape, strategy)[0], shape)

    problems = _nontrivial(want)
    if strategy == "regather":
        problems += _compare({"loss": got_loss, **got}, {"loss": want_loss, **want}, bitwise=True)
    else:
        _, ref = _fp32_reference(shape)
        problems += _compare({"loss": got_loss}, {"loss": want_loss}, bitwise=False, tol=BF16_LOSS_REL_TOL)
        problems += _compare(got, want, bitwise=False, tol=BF16_GRAD_REL_TOL)
        ours_err, bridge_err = _norm_rel_err(got, ref), _norm_rel_err(want, ref)
        if ours_err > BF16_ACCURACY_RATIO * bridge_err:
            problems.append(f"error vs fp32: ours {ours_err:.3g} > {BF16_ACCURACY_RATIO} x Bridge's {bridge_err:.3g}")
    assert_no_problems(problems, tp2)


# ------------------------------------------------------------------------------------ 2. memory


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eligible_lora_a_retains_exactly_the_sequence_shard(tp2, strategy, kind):
    """Per LoRA-A, Bridge's gathered input against our shard; per adapted layer, one shard however many
    adapters it has (CanonicalLoRA's q, k, v and up, gate); every LoRA-A counted as a LoRA input."""
    shape = _shape(kind)
    batch = tm.synthetic_batch(shape)
    results = {}
    for variant in ("baseline", strategy):
        model, _ = _gpt(shape, variant)
        with SavedActivationMeter(model) as meter:
            tm.loss_of(model, batch)
        results[variant] = meter.result()

    itemsize = shape.torch_dtype.itemsize
    gathered = shape.seq * shape.micro_batch * shape.hidden * itemsize  # the [s, b, h] LoRA-A input
    shard = gathered // TP  # the local sequence shard [s/t, b, h]
    eligible = [path for _, path in _adapters(shape, ELIGIBLE_SURFACES)]
    others = [path for _, path in _adapters(shape, ("linear_proj", "linear_fc2"))]
    layers = len(_adapter_names(shape, ELIGIBLE_SURFACES))  # adapted linear_qkv and linear_fc1 layers

    problems = []
    for variant, per_adapter in (("baseline", gathered), (strategy, shard)):
        result = results[variant]
        got = {name: result.by_module.get(name) for name in eligible}
        if got != dict.fromkeys(eligible, per_adapter):
            problems.append(f"{variant}: LoRA-A saved {got}, expected {per_adapter} each")
        filed = {name: result.module_categories.get(name) for name in eligible + others}
        if set(filed.values()) != {"lora_input"}:
            problems.append(f"{variant}: LoRA-A modules filed as {filed}")
        lora_total = result.module_bytes("lora_input")
        if lora_total != sum(result.by_module.get(name, 0) for name in eligible + others):
            problems.append(f"{variant}: lora_input {lora_total} is not the sum of the adapters' LoRA-A")
    # Row-parallel adapters are untouched.
    for name in others:
        if results["baseline"].by_module.get(name) != results[strategy].by_module.get(name):
            problems.append(f"{name}: changed")
    # The whole drop. Each of Bridge's LoRA-A saves its own gathered [s, b, h] copy of its input
    # (CanonicalLoRA's q, k and v each gather for themselves), held by nothing else. Ours save the
    # shard x_k, the base linear's own input (the LayerNorm output): the frozen base linear saves only
    # its weight and LayerNorm saves its input, not its output, so the shard is the only copy
    # retained, a new s*b*h/t, one storage for all adapters of the layer. Everything else (LoRA-B's
    # [s, b, r] input, norms, attention, DoRA's magnitude terms, ...) is the same. Hence per adapted
    # layer with n adapters the total drops by s*b*h*(n - 1/t), all of it in the LoRA inputs.
    expected = len(eligible) * gathered - layers * shard
    drop = results["baseline"].total_bytes - results[strategy].total_bytes
    lora_drop = results["baseline"].by_category["lora_input"] - results[strategy].by_category["lora_input"]
    if (drop, lora_drop) != (expected, expected):
        problems.append(f"total saved bytes dropped by {drop}, LoRA inputs by {lora_drop}, expected "
                        f"{len(eligible)} x {gathered} - {layers} x {shard} = {expected}")
    assert_no_problems(problems, tp2)


# ------------------------------------------------------------------------------------ 3. communication


def _adapter_collectives(tp_group, variant: str, input_needs_grad: bool = True):
    """Collectives of one eligible adapter's forward+backward, as sorted (phase, kind, elements), and the counter."""
    block = _block(_column_parallel(tp_group), "linear_qkv", variant)
    adapter = _lora_linear(block).adapter
    x, _ = _problem(seed=102)
    gen = torch.Generator().manual_seed(103)
    g = torch.randn(S, B, OUT, generator=gen).to(_device())
    x_local = _rank_slice(x, 0, tp_group).detach().clone().requires_grad_(input_needs_grad)
    with CollectiveCounter(block) as counter:
        out = adapter(x_local)  # what LoRALinear hands the adapter: the base linear's input shard
        (out * _rank_slice(g, -1, tp_group)).sum().backward()
    return sorted((c.phase, c.kind, c.elements) for c in counter.calls), counter


@pytest.mark.parametrize("input_needs_grad", [True, False], ids=["input grad", "no input grad"])
def test_adapter_collectives_per_strategy(tp2, input_needs_grad):
    """One eligible adapter, forward and backward. Without an input grad (the first layer under a
    frozen embedding) the baseline's gather has no backward, and neither strategy adds any."""
    sbh, sbr, rh = S * B * H, S * B * R, R * H
    assert len({sbh, sbr, rh}) == 3
    # LoRA-B (a ColumnParallelLinear) all-reduces its input grad [s, b, r] in every variant.
    lora_b = [("backward", "all_reduce", sbr)]
    dgrad = input_needs_grad
    expected = {
        # gather x, LoRA-A, gather the rank dim [s, b, r]; backward reduce-scatters x's grad.
        "baseline": [("forward", "all_gather", sbh), ("forward", "all_gather", sbr)]
        + [("backward", "reduce_scatter", sbh)] * dgrad,
        # the same, plus the re-gather of x in backward for LoRA-A's weight grad.
        "regather": [("forward", "all_gather", sbh), ("forward", "all_gather", sbr), ("backward", "all_gather", sbh)]
        + [("backward", "reduce_scatter", sbh)] * dgrad,
        # gather A [r, h] and the hidden [s, b, r]; backward reduce-scatters A's grad and, for x's grad, gathers A.
        "shard_local": [("forward", "all_gather", rh), ("forward", "all_gather", sbr), ("backward", "reduce_scatter", rh)]
        + [("backward", "all_gather", rh)] * dgrad,
    }
    problems = []
    for variant, calls in expected.items():
        got, counter = _adapter_collectives(tp2, variant, input_needs_grad)
        if got != sorted(calls + lora_b):
            problems.append(f"{variant}: {got}, expected {sorted(calls + lora_b)}")
        if variant == "shard_local":
            largest = max(c.elements for c in counter.calls)
            if largest > max(sbr, rh):
                problems.append(f"shard_local: a collective of {largest} elements (> max(s*b*r, r*h))")
        if variant != "baseline":
            modules = {c.module for c in counter.select(phase="forward")}
            if modules != {"linear_qkv.adapter.linear_in"}:
                problems.append(f"{variant}: forward collectives attributed to {modules}")
    assert_no_problems(problems, tp2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_a_functions_with_a_frozen_weight_skip_the_weight_grad_work(tp2, strategy):
    """Called with a weight that needs no grad, neither function re-gathers x (regather) nor
    reduce-scatters a weight grad (shard-local); the input grad is still Bridge's."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    from megatron_bridge_ext.levers.lora_input import sp_lora

    x, _ = _problem(seed=106)
    gen = torch.Generator().manual_seed(107)
    weight = _rank_slice(torch.randn(R, H, generator=gen), 0, tp2).to(_device())
    g = torch.randn(S, B, R, generator=gen).to(_device())
    grads, calls = {}, {}
    for variant in ("baseline", strategy):
        x_local = _rank_slice(x, 0, tp2).detach().clone().requires_grad_(True)
        with CollectiveCounter() as counter:
            if variant == "baseline":
                total = gather_from_sequence_parallel_region(x_local, group=tp2)
                y = gather_from_tensor_model_parallel_region(total.matmul(weight.t()), group=tp2)
            else:
                y = sp_lora.lora_a_output(variant, x_local, weight, tp2)
            (copy_to_tensor_model_parallel_region(y, group=tp2) * g).sum().backward()
        grads[variant] = {"input grad": x_local.grad}
        calls[variant] = sorted((c.kind, c.elements) for c in counter.select(phase="backward"))
    sbh, sbr, rh = S * B * H, S * B * R, R * H
    expected = {
        "regather": [("all_reduce", sbr), ("reduce_scatter", sbh)],  # no re-gather of x
        "shard_local": [("all_gather", rh), ("all_reduce", sbr)],  # A for the input grad, no wgrad reduce-scatter
    }[strategy]
    problems = _compare(grads[strategy], grads["baseline"], bitwise=strategy == "regather")
    if calls[strategy] != expected:
        problems.append(f"backward collectives {calls[strategy]}, expected {expected}")
    assert_no_problems(problems, tp2)


def _model_collectives(shape: tm.TinyGPTShape, variant: str, **config):
    """Collectives of one whole-model step as a Counter of (phase, kind, elements), and the number of
    eligible LoRA-A whose input needs a grad (not the first layer's ``linear_qkv``: the embedding is
    frozen, so nothing upstream of it needs one, unless recompute makes the block input require it)."""
    model, _ = _gpt(shape, variant, **config)
    needs_grad = {}

    def record(name):
        def hook(module, args):
            if torch.is_grad_enabled():
                needs_grad[name] = args[0].requires_grad
        return hook

    for _, path in _adapters(shape, ELIGIBLE_SURFACES):
        model.get_submodule(path).register_forward_pre_hook(record(path))
    with CollectiveCounter(model) as counter:
        tm.loss_of(model, tm.synthetic_batch(shape)).backward()
    calls = collections.Counter((c.phase, c.kind, c.elements) for c in counter.calls)
    return calls, sum(needs_grad.values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_whole_model_collectives_differ_from_bridge_only_at_lora_a(tp2, strategy, kind):
    """Counted per eligible LoRA-A: CanonicalLoRA's adapters of a layer share the retained shard, but
    each computes its own LoRA-A (Bridge's gather each their own input too)."""
    shape = _shape(kind, micro_batch=3)  # s*b*h, s*b*r and r*h all differ
    sbh, rh = shape.seq * shape.micro_batch * shape.hidden, shape.lora_rank * shape.hidden
    n = len(_adapters(shape, ELIGIBLE_SURFACES))
    (baseline, n_dgrad), (ours, _) = _model_collectives(shape, "baseline"), _model_collectives(shape, strategy)
    added, removed = ours - baseline, baseline - ours
    if strategy == "regather":
        # One re-gather of x per adapter for its wgrad; nothing else changes.
        expected_added, expected_removed = {("backward", "all_gather", sbh): n}, {}
    else:
        # x is never gathered; A is gathered in forward, and in backward only for an input grad.
        expected_added = {("forward", "all_gather", rh): n, ("backward", "all_gather", rh): n_dgrad,
                          ("backward", "reduce_scatter", rh): n}
        expected_removed = {("forward", "all_gather", sbh): n, ("backward", "reduce_scatter", sbh): n_dgrad}
    first_qkv = len(_adapters(dataclasses.replace(shape, layers=1), ["linear_qkv"]))
    problems = [] if n_dgrad == n - first_qkv else [
        f"{n_dgrad} of {n} LoRA-A inputs need a grad: expected all but the first layer's linear_qkv's {first_qkv}"]
    if dict(added) != expected_added:
        problems.append(f"added {dict(added)}, expected {expected_added}")
    if dict(removed) != expected_removed:
        problems.append(f"removed {dict(removed)}, expected {expected_removed}")
    assert_no_problems(problems, tp2)


# ------------------------------------------------------------------------------------ 4. checkpoints

TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _state_problems(got: dict, want: dict, label: str) -> list[str]:
    problems = []
    if list(got) != list(want):
        problems.append(f"{label}: keys differ: {sorted(set(got) ^ set(want))}")
    for key, w in want.items():
        g = got.get(key)
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w):
                problems.append(f"{label}: {key} differs")
        elif hasattr(w, "getvalue"):
            if not hasattr(g, "getvalue") or g.getvalue() != w.getvalue():
                problems.append(f"{label}: {key} (extra state) differs")
        elif g != w:
            problems.append(f"{label}: {key}: {g!r} != {w!r}")
    return problems


def _flat_sharded(state, prefix=""):
    """Leaves of a sharded state dict with their checkpoint metadata (no data)."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _flat_sharded(value, f"{prefix}{key}/")
        return
    if isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from _flat_sharded(value, f"{prefix}{index}/")
        return
    meta = tuple(
        (attr, tuple(v) if isinstance(v, (list, torch.Size)) else v)
        for attr in ("key", "global_shape", "global_offset", "axis_fragmentations", "replica_id", "local_shape",
                     "prepend_axis_num", "flattened_range", "dtype")
        if (v := getattr(state, attr, None)) is not None
    )
    yield prefix, type(state).__name__, meta


def _shared_dir(tmp_path_factory, name: str, group) -> str:
    """An empty directory, the same on every rank (rank 0 creates it)."""
    path = [str(tmp_path_factory.mktemp(name)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _dist_checkpoint_round(source, target, directory: str) -> None:
    """Save ``source`` with Megatron's distributed checkpointing, load it strictly into ``target``.

    Strict: every key and global shape of the checkpoint must match ``target``'s sharded state
    dict and vice versa (``StrictHandling.RAISE_ALL`` raises otherwise). The loaded tensors are then
    copied in as Bridge does when it resumes a PEFT run (``load_state_dict(strict=False)``).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    dist_checkpointing.save(source.sharded_state_dict(), directory)
    loaded = dist_checkpointing.load(target.sharded_state_dict(), directory, strict=StrictHandling.RAISE_ALL)
    target.load_state_dict(loaded, strict=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoints_move_between_bridge_and_our_lora(tp2, tmp_path_factory, monkeypatch, strategy, kind):
    """Same parameters, state dicts and distributed checkpoints as Bridge's class of the same kind, both ways.

    Bridge's ``LoRALinear.state_dict()`` (and DoRA's and CanonicalLoRA's wrappers') names the base weight
    without the ``to_wrap.`` level that ``load_state_dict`` expects, so no Bridge LoRA model reloads even
    its own ``state_dict()`` strictly; Bridge resumes PEFT runs from distributed checkpoints, loading with
    ``strict=False``. The test therefore requires: identical ``state_dict()`` keys, shapes and dtypes; a
    plain ``load_state_dict`` that reports exactly the mismatches Bridge -> Bridge reports; and a strict
    (``RAISE_ALL``) distributed-checkpoint load in both directions, after which every tensor is what
    Bridge's class resumes from the same checkpoint.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not torch.cuda.is_available():
        # The checkpoint writer stages tensors to the CPU and then waits for the device; there is none.
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    if not filesystem_async.HAVE_PSUTIL:
        # The writer logs its process memory through psutil, which this environment may lack.
        monkeypatch.setattr(filesystem_async, "_process_memory", lambda: 0)
    shape = _shape(kind)
    bridge_model, _ = _gpt(shape, "baseline", seed=11, peft_seed=12)
    ours, _ = _gpt(shape, strategy, seed=21, peft_seed=22)
    problems = []

    # Same parameters: names, shapes, trainability and tensor-parallel attributes.
    def describe(model):
        return {
            name: (tuple(p.shape), p.dtype, p.requires_grad, tuple(getattr(p, a, None) for a in TP_ATTRIBUTES))
            for name, p in model.named_parameters()
        }

    if describe(ours) != describe(bridge_model):
        problems.append("parameter names, shapes or TP attributes differ")
    adapter_params = [name for name in describe(ours) if ".adapter." in name]
    lora_params = [name for name in adapter_params if name.endswith(("linear_in.weight", "linear_out.weight"))]
    if len(lora_params) != 2 * len(_adapters(shape)) or any(describe(ours)[n][3][0] is not True for n in lora_params):
        problems.append(f"LoRA parameters and their tensor_model_parallel flags: {lora_params}")
    magnitudes = [name for name in adapter_params if name.endswith(".adapter.weight_magnitude")]
    if sorted(adapter_params) != sorted(lora_params + magnitudes) or len(magnitudes) != (
            len(_adapters(shape)) if kind == "dora" else 0):
        problems.append(f"adapter parameters: {adapter_params}")

    bridge_state = bridge_model.state_dict()
    ours_state = ours.state_dict()
    if [(k, getattr(v, "shape", None)) for k, v in ours_state.items()] != [
        (k, getattr(v, "shape", None)) for k, v in bridge_state.items()
    ]:
        problems.append("state_dict keys or shapes differ")
    if not any(isinstance(v, torch.Tensor) and ".adapter." in k and not torch.equal(v, ours_state[k])
               for k, v in bridge_state.items()):
        problems.append("the two models start with equal adapters: a load would prove nothing")

    # Plain state dicts: the same (Bridge-inherent) mismatches as between two Bridge models.
    probe, _ = _gpt(shape, "baseline", seed=41, peft_seed=42)
    want_report = probe.load_state_dict(bridge_state, strict=False)
    got_report = ours.load_state_dict(bridge_state, strict=False)
    if (sorted(got_report.missing_keys), sorted(got_report.unexpected_keys)) != (
        sorted(want_report.missing_keys), sorted(want_report.unexpected_keys)
    ) or any(".adapter." in k for k in got_report.missing_keys + got_report.unexpected_keys):
        problems.append(f"load_state_dict mismatches {got_report} vs Bridge's {want_report}")
    adapters_only = lambda state: {k: v for k, v in state.items() if ".adapter." in k}  # noqa: E731
    problems += _state_problems(adapters_only(ours.state_dict()), adapters_only(bridge_state), "state_dict Bridge -> ours")

    # Distributed checkpoints, strictly, both ways (into fresh models with other weights), against what
    # Bridge's class resumes from Bridge's own checkpoint.
    bridge_resumed, _ = _gpt(shape, "baseline", seed=31, peft_seed=32)
    _dist_checkpoint_round(bridge_model, bridge_resumed, _shared_dir(tmp_path_factory, "bridge_bridge_ckpt", tp2))
    want = bridge_resumed.state_dict()
    ours, _ = _gpt(shape, strategy, seed=51, peft_seed=52)
    _dist_checkpoint_round(bridge_model, ours, _shared_dir(tmp_path_factory, "bridge_ckpt", tp2))
    problems += _state_problems(ours.state_dict(), want, "checkpoint Bridge -> ours")
    fresh_bridge, _ = _gpt(shape, "baseline", seed=61, peft_seed=62)
    _dist_checkpoint_round(ours, fresh_bridge, _shared_dir(tmp_path_factory, "ours_ckpt", tp2))
    problems += _state_problems(fresh_bridge.state_dict(), want, "checkpoint ours -> Bridge")
    # Lossless, but for what Bridge's own DoRA loses: the magnitude of a row-parallel layer is computed
    # from the rank's own input columns (a different vector on every TP rank) and checkpointed as one
    # replicated tensor, so every rank resumes with rank 0's.
    lost = sorted(k for k, v in bridge_state.items() if isinstance(v, torch.Tensor) and not torch.equal(v, want[k]))
    rows = [f"{name}.adapter.weight_magnitude" for name in _adapter_names(shape, ("linear_proj", "linear_fc2"))]
    if lost != (sorted(rows) if kind == "dora" and dist.get_rank() != 0 else []):
        problems.append(f"Bridge's own checkpoint round trip changed {lost}")

    # The sharded state dicts carry the same keys and metadata.
    if list(_flat_sharded(ours.sharded_state_dict())) != list(_flat_sharded(bridge_model.sharded_state_dict())):
        problems.append("sharded_state_dict differs")

    # The loaded model computes what Bridge's class computes from the same checkpoint.
    want_loss, _ = _loss_and_grads(bridge_resumed, shape)
    got_loss, _ = _loss_and_grads(ours, shape)
    problems += _compare({"loss": got_loss}, {"loss": want_loss}, bitwise=strategy == "regather")
    assert_no_problems(problems, tp2)


# ------------------------------------------------------------------------------------ 5. eligibility & report


def _apply_logged(caplog, build):
    """Run ``build`` (returns (model, peft)) while capturing the INFO logs of our PEFT classes; each case is a run
    of its own, so the reasons logged before it are forgotten (each is logged once per run)."""
    from megatron_bridge_ext.levers.lora_input import sp_input

    sp_input.new_run()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=PEFT_LOGGER):
        model, peft = build()
    records = [r.getMessage() for r in caplog.records if r.name.startswith(PEFT_LOGGER + ".")]
    return model, peft, records


def _mutated_gpt(shape, strategy, **fields):
    """The tiny GPT with config fields set after construction (features the CPU cannot build)."""
    model = tm.build_gpt(shape)
    for key, value in fields.items():
        setattr(model.config, key, value)
    peft = VARIANTS[strategy].apply(shape).peft
    return tm.apply_peft(model, peft), peft


_RECOMPUTE_FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
_RECOMPUTE_MLP = dict(recompute_granularity="selective", recompute_modules=["mlp"])

_ROW_PARALLEL_REFUSED = {"linear_qkv": None, "linear_fc1": None, "linear_proj": "linear_proj is not a column-parallel",
                         "linear_fc2": "linear_fc2 is not a column-parallel"}

# (case, kind, strategy, how to build, {surface: expected reason fragment or None for eligible})
_GPT_CASES = [
    ("row-parallel surfaces", "lora", "regather", lambda s, k: _gpt(s, k), _ROW_PARALLEL_REFUSED),
    ("DoRA, row-parallel surfaces", "dora", "shard_local", lambda s, k: _gpt(s, k), _ROW_PARALLEL_REFUSED),
    ("CanonicalLoRA, row-parallel surfaces", "canonical_lora", "shard_local", lambda s, k: _gpt(s, k),
     _ROW_PARALLEL_REFUSED),
    ("sequence parallelism off", "lora", "shard_local",
     lambda s, k: _gpt(dataclasses.replace(s, sequence_parallel=False), k),
     {"linear_qkv": "sequence parallelism is off", "linear_fc1": "sequence parallelism is off"}),
    ("CUDA graphs", "lora", "shard_local", lambda s, k: _mutated_gpt(s, k, cuda_graph_impl="local"),
     {"linear_qkv": "CUDA graphs", "linear_fc1": "CUDA graphs"}),
    ("CPU activation offloading", "lora", "regather",
     lambda s, k: _mutated_gpt(s, k, cpu_offloading=True, cpu_offloading_activations=True),
     {"linear_qkv": "CPU activation offloading", "linear_fc1": "CPU activation offloading"}),
    ("full recompute, regather", "lora", "regather", lambda s, k: _gpt(s, k, **_RECOMPUTE_FULL),
     {"linear_qkv": "full activation recompute", "linear_fc1": "full activation recompute"}),
    ("full recompute, shard_local", "lora", "shard_local", lambda s, k: _gpt(s, k, **_RECOMPUTE_FULL),
     {"linear_qkv": None, "linear_fc1": None}),
    ("mlp recompute, regather", "lora", "regather", lambda s, k: _gpt(s, k, **_RECOMPUTE_MLP),
     {"linear_qkv": None, "linear_fc1": "selective 'mlp' recompute"}),
    ("CanonicalLoRA, mlp recompute, regather", "canonical_lora", "regather", lambda s, k: _gpt(s, k, **_RECOMPUTE_MLP),
     {"linear_qkv": None, "linear_fc1": "selective 'mlp' recompute"}),
    ("mlp recompute, shard_local", "lora", "shard_local", lambda s, k: _gpt(s, k, **_RECOMPUTE_MLP),
     {"linear_qkv": None, "linear_fc1": None}),
]


@pytest.mark.parametrize("case, kind, strategy, build, expected", _GPT_CASES, ids=[c[0] for c in _GPT_CASES])
def test_eligibility_in_the_tiny_gpt_with_one_log_per_reason(tp2, caplog, case, kind, strategy, build, expected):
    """Every adapter is reported, with LoRA-A switched exactly where eligible; CanonicalLoRA's adapters of
    one layer share its verdict (a row each)."""
    shape = _shape(kind)
    model, peft, records = _apply_logged(caplog, lambda: build(shape, strategy))
    report = peft.report()
    problems = []
    if sorted((d.adapter, d.lora_a) for d in report) != sorted(_adapters(shape)):
        problems.append(f"report lists {[(d.adapter, d.lora_a) for d in report]}")
    for decision in report:
        surface = decision.lora_a.split(".adapter.")[0].rsplit(".", 1)[-1]
        if surface not in expected:
            continue
        want = expected[surface]
        if want is None and (decision.strategy != strategy or decision.reason != "eligible"):
            problems.append(f"{decision.adapter}: {decision}")
        if want is not None and (decision.eligible or want not in decision.reason):
            problems.append(f"{decision.adapter}: {decision.reason!r} lacks {want!r}")
        lora_a = model.get_submodule(decision.lora_a)
        if (type(lora_a).__name__ == "SequenceParallelLoRAIn") != decision.eligible:
            problems.append(f"{decision.adapter}: LoRA-A class {type(lora_a).__name__} vs {decision}")
    # Each fallback reason is logged once, however many adapters share it, in report()'s words: what LoRA-A
    # retains (a row-parallel linear_proj keeps its already split input, not a gathered one).
    reasons = {d.reason for d in report if not d.eligible}
    fallbacks = [m for m in records if ") not used: " in m]
    if len(fallbacks) != len(reasons) or any(sum(r in m for m in fallbacks) != 1 for r in reasons):
        problems.append(f"fallback logs {fallbacks} for reasons {reasons}")
    unlike_report = [m for m in fallbacks if not any(d.describe() in m for d in report if not d.eligible)]
    if unlike_report:
        problems.append(f"fallback logs not in report()'s words: {unlike_report}")
    summary = f"applied to {sum(d.eligible for d in report)} of {len(report)} adapters"
    if not any(summary in m for m in records):
        problems.append(f"no summary {summary!r} in {records}")
    assert_no_problems(problems, tp2)


def _row_parallel(tp_group):
    from megatron.core.tensor_parallel import RowParallelLinear

    torch.manual_seed(7)
    return RowParallelLinear(
        H, OUT, config=_parallel_config(), init_method=nn.init.xavier_normal_, bias=False,
        input_is_parallel=True, skip_bias_add=True, tp_group=tp_group,
    )


def _explicit_comm(tp_group):
    base = _column_parallel(tp_group)
    base.explicit_expert_comm = True  # what SharedExpertMLP sets with moe_shared_expert_overlap
    return base


# (case, base builder, attribute path prefix, surface, expected reason fragment)
_BLOCK_CASES = [
    ("row-parallel base named linear_fc1", _row_parallel, "", "linear_fc1", "the adapter is row-parallel"),
    ("expert linear_fc1", _column_parallel, "mlp.experts.local_experts.0", "linear_fc1",
     "expert adapters are not supported"),
    ("shared expert without SP communication", _explicit_comm, "mlp.shared_experts", "linear_fc1",
     "the base linear does no sequence-parallel communication"),
]


@pytest.mark.parametrize("case, base, prefix, surface, reason", _BLOCK_CASES, ids=[c[0] for c in _BLOCK_CASES])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eligibility_of_special_bases(tp2, caplog, strategy, case, base, prefix, surface, reason):
    _, peft, records = _apply_logged(caplog, lambda: _wrap(base(tp2), surface, strategy, prefix=prefix))
    report = peft.report()
    problems = []
    if len(report) != 1 or report[0].eligible or reason not in report[0].reason:
        problems.append(f"{case}: {report}")
    elif not any(report[0].reason in m for m in records):
        problems.append(f"{case}: fallback not logged: {records}")
    assert_no_problems(problems, tp2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_a_frozen_after_transform_falls_back_to_the_gathered_path(tp2, strategy):
    """Decided eligible, then LoRA-A frozen: the adapter computes Bridge's frozen result and retains nothing."""
    from megatron_bridge_ext.levers.lora_input.eligibility import decide

    x, g = _problem(seed=104)
    results, saved = {}, {}
    problems = []
    for variant in ("baseline", strategy):
        block = _block(_column_parallel(tp2), "linear_qkv", variant)
        lora_linear = _lora_linear(block)
        lora_linear.adapter.linear_in.weight.requires_grad_(False)
        with SavedActivationMeter(block) as meter:
            results[variant] = _run_lora_linear(lora_linear, x, g, tp2)
        saved[variant] = meter.result().module_bytes("lora_input")
        if variant == strategy:
            verdict = decide(lora_linear, strategy)
            if verdict.eligible or "LoRA-A is frozen" not in verdict.reason:
                problems.append(f"decide on a frozen LoRA-A: {verdict}")
    del results["baseline"]["LoRA-A grad"], results[strategy]["LoRA-A grad"]
    problems += _compare(results[strategy], results["baseline"], bitwise=True)
    if saved != {"baseline": 0, strategy: 0}:
        problems.append(f"LoRA-A retained {saved}")
    assert_no_problems(problems, tp2)


# ------------------------------------------------------------------------------------ 6. full recompute


class _BackwardSaves:
    """Bytes of the distinct non-parameter storages autograd saves while backward runs (recompute)."""

    def __init__(self, model):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._storages: dict[int, torch.UntypedStorage] = {}  # held, so that no address is reused

    def _pack(self, tensor):
        if torch._C._current_autograd_node() is not None:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._params:
                self._storages.setdefault(storage.data_ptr(), storage)
        return tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(storage.nbytes() for storage in self._storages.values())


def test_shard_local_under_full_recompute_matches_bridge_under_the_same_recompute(tp2):
    """Full recompute (upstream refuses its regather there) with shard-local: the claims of eligibility.py.

    * correct: loss and every gradient within 1e-6 of Bridge's LoRA under the same recompute;
    * communication: in the first forward and again in the recomputed forward, LoRA-A's s*b*h
      all-gather of the input is gone (replaced by gathers of the r x h weight; the [s, b, r] gather
      is the same in both), and so is the s*b*h reduce-scatter of its input grad;
    * memory: what lives during each recomputed backward shrinks from the gathered s*b*h input to
      the shard, s*b*h*(1 - 1/t) less per eligible adapter.
    """
    shape = tm.TinyGPTShape()
    sbh, rh = shape.seq * shape.micro_batch * shape.hidden, shape.lora_rank * shape.hidden
    n = len(_adapter_names(shape, ELIGIBLE_SURFACES))
    runs = {}
    for variant in ("baseline", "shard_local"):
        model, peft = _gpt(shape, variant, **_RECOMPUTE_FULL)
        with CollectiveCounter(model) as counter, _BackwardSaves(model) as saves:
            loss, grads = _loss_and_grads(model, shape)
        calls = collections.Counter((c.phase, c.kind, c.elements) for c in counter.calls)
        runs[variant] = (loss, grads, calls, saves.nbytes, peft)

    (want_loss, want, base_calls, base_saved, _), (got_loss, got, calls, saved, peft) = runs["baseline"], runs["shard_local"]
    problems = _compare({"loss": got_loss, **got}, {"loss": want_loss, **want}, bitwise=False) + _nontrivial(want)
    eligible = sorted(d.adapter for d in peft.report() if d.strategy == "shard_local")
    if eligible != sorted(_adapter_names(shape, ELIGIBLE_SURFACES)):
        problems.append(f"shard_local applied to {eligible}")
    expected_removed = {("forward", "all_gather", sbh): n, ("backward", "all_gather", sbh): n,
                        ("backward", "reduce_scatter", sbh): n}
    expected_added = {("forward", "all_gather", rh): n, ("backward", "all_gather", rh): 2 * n,
                      ("backward", "reduce_scatter", rh): n}
    if dict(base_calls - calls) != expected_removed or dict(calls - base_calls) != expected_added:
        problems.append(f"removed {dict(base_calls - calls)}, added {dict(calls - base_calls)}")
    itemsize = shape.torch_dtype.itemsize
    if base_saved - saved != n * (sbh - sbh // TP) * itemsize:
        problems.append(f"recomputed saves: {base_saved} -> {saved}")
    assert_no_problems(problems, tp2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_transforming_an_already_transformed_model_changes_nothing(tp2, strategy):
    """Applying the same LoRA twice (a resumed script, a second setup call) neither wraps nor decides again."""
    from megatron.bridge.peft.lora_layers import LoRALinear

    shape = tm.TinyGPTShape()
    model, peft = _gpt(shape, strategy)
    before_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    before_report = list(peft.report())
    x = tm.synthetic_batch(shape, 0)
    loss_before = tm.loss_of(model, x).detach()
    again = peft(model, training=True)
    again = again[0] if isinstance(again, list) else again
    problems = []
    if again is not model:
        problems.append("a new model object")
    if {n for n, _ in model.named_parameters()} != set(before_params):
        problems.append("parameters added or renamed")
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if len(wrapped) != shape.layers * len(shape.lora_targets) or any(".to_wrap.adapter" in n for n in wrapped):
        problems.append(f"adapters wrapped again: {wrapped}")
    if peft.report() != before_report:
        problems.append("the report changed")
    if not torch.equal(tm.loss_of(model, x).detach(), loss_before):
        problems.append("the output changed")
    assert_no_problems(problems, tp2)
