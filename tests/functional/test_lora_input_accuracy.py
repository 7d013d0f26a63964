"""How accurate the LoRA-A strategies are, against a float64 reference, at TP = the world size.

Runs in the 2-rank suite (TP=2) and in a 4-rank run (TP=4: ``make functional-tp4``). The same tiny GPT
is built in float32 and float64 from the same weights (Megatron Core draws CPU-initialised weights in
float32 and casts them, so the float64 model is the exact upcast; checked). The float64 run of
Bridge's LoRA is the reference; each float32 run's error is the largest relative error over the loss
and every LoRA gradient. Claim: shard_local sums partial products over ranks in another order than
the baseline, so it is not bitwise equal to it, but it is no less accurate: its error against the
float64 reference is at most twice the baseline's own float32 error. Regather is bitwise equal to the
baseline, so it has exactly the baseline's error. At TP=4 in bfloat16 it also checks that shard_local
reduces LoRA-A's weight gradient over the ranks in float32, the one rule here a TP=2 run cannot test.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from megatron_bridge_ext.levers.lora_input import sp_lora
from megatron_bridge_ext.testing import tiny_model as tm
from tests.support.dist_checks import assert_no_problems, local_rel_err
from tests.support.lora_blocks import _gpt, _loss_and_grads

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


@pytest.fixture(scope="module")
def tp_world():
    """TP over every rank: 2 in the usual suite, 4 in ``make functional-tp4``."""
    from megatron.core import parallel_state

    from megatron_bridge_ext.testing import distributed

    distributed.init_from_env(tensor_parallel=WORLD)
    yield parallel_state.get_tensor_model_parallel_group()
    if WORLD != 2:
        return
    distributed.init_from_env(tensor_parallel=2)  # what the other modules of the 2-rank suite expect


def _shape(dtype: str) -> tm.TinyGPTShape:
    return tm.TinyGPTShape(tp=WORLD, heads=4, kv_heads=4, lora_rank=8, dtype=dtype)


def _run(variant: str, dtype: str):
    model, _ = _gpt(_shape(dtype), variant)
    loss, grads = _loss_and_grads(model, _shape(dtype))
    return model, {"loss": loss.reshape(1), **grads}


def _error(got: dict, want: dict) -> float:
    return max(local_rel_err(got[name], want[name]) for name in want)


def test_shard_local_is_as_accurate_as_the_baseline_against_float64(tp_world):
    reference_model, reference = _run("baseline", "float64")
    base_model, baseline = _run("baseline", "float32")
    _, regather = _run("regather", "float32")
    _, shard_local = _run("shard_local", "float32")
    problems = []
    upcast = {n: p.detach().double() for n, p in base_model.named_parameters()}
    if any(not torch.equal(upcast[n], p.detach()) for n, p in reference_model.named_parameters()):
        problems.append("the float64 model is not the upcast of the float32 one")
    errors = {name: _error(run, reference) for name, run in
              (("baseline", baseline), ("regather", regather), ("shard_local", shard_local))}
    global_errors = {name: torch.tensor(err, dtype=torch.float64) for name, err in errors.items()}
    for value in global_errors.values():
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=tp_world)
    errors = {name: value.item() for name, value in global_errors.items()}
    if not 0 < errors["baseline"] < 1e-4:
        problems.append(f"baseline float32 error {errors['baseline']:.3g}: the comparison measures nothing")
    if errors["regather"] != errors["baseline"]:
        problems.append(f"regather {errors['regather']:.3g} != baseline {errors['baseline']:.3g}")
    if errors["shard_local"] > 2 * errors["baseline"]:
        problems.append(f"shard_local {errors['shard_local']:.3g} > 2 x baseline {errors['baseline']:.3g}")
    if dist.get_rank() == 0:
        print(f"\nTP={WORLD} float32 error against float64: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert_no_problems(problems, tp_world)


def _bf16_problem(s: int, b: int, h: int, r: int):
    """Global x [s, b, h], LoRA-A weight A [r, h] and the replicated grad G [s, b, r] in bfloat16, the same on
    every rank."""
    gen = torch.Generator().manual_seed(29)
    return tuple(torch.randn(*shape, generator=gen, dtype=torch.float64).to(torch.bfloat16)
                 for shape in ((s, b, h), (r, h), (s, b, r)))


@pytest.mark.skipif(WORLD < 3, reason="two bf16 addends: their bf16 sum is their float32 sum rounded once, so a "
                                      "bf16 reduction gives the same bits and the rule cannot fail at TP=2")
def test_shard_local_reduces_the_bf16_weight_gradient_in_float32(tp_world):
    """Each rank's partial wgrad of LoRA-A is G_k^T x_k [r, h] over its own tokens, in bf16; the shard_local
    rule is that these t partials are summed in float32 and rounded to bf16 once (into an fp32 main_grad: not
    rounded at all). Two bf16 addends (TP=2) sum in float32 exactly, and bf16 addition rounds that exact sum
    once too, so the rule is only visible from three ranks on, where a bf16 reduction rounds after every
    addition. The expected shard is formed here from every rank's partial (all ranks hold the whole problem),
    summed in float64 (exact for four bf16 products of this size) and rounded, and a bf16 running sum is
    checked to differ from it, so the comparison can tell the two reductions apart."""
    t, rank = tp_world.size(), tp_world.rank()
    s, b, h, r = 16 * t, 2, 32, 2 * t
    x, a, g = _bf16_problem(s, b, h, r)
    tokens, rows = s // t, r // t
    partials = [g[k * tokens:(k + 1) * tokens].reshape(-1, r).t().matmul(x[k * tokens:(k + 1) * tokens].reshape(-1, h))
                for k in range(t)]
    exact = sum(p.double() for p in partials)[rank * rows:(rank + 1) * rows]
    running = partials[0]
    for p in partials[1:]:
        running = running + p  # bf16: rounded after each addition
    running = running[rank * rows:(rank + 1) * rows]
    problems = []
    if torch.equal(running, exact.to(torch.bfloat16)):
        problems.append("a bf16 running sum equals the float32 one here: the problem cannot tell them apart")
    for fusion in (False, True):
        x_local = x[rank * tokens:(rank + 1) * tokens].clone().requires_grad_(True)
        weight = a[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
        if fusion:
            weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
        sp_lora.shard_local_lora_a(x_local, weight, tp_world, gradient_accumulation_fusion=fusion).backward(g)
        got, want = (weight.main_grad, exact.float()) if fusion else (weight.grad, exact.to(torch.bfloat16))
        if got.dtype != want.dtype or not torch.equal(got, want):
            wrong = (got.double() != want.double()).sum().item() if got.shape == want.shape else "all"
            problems.append(f"fusion={fusion}: {wrong} of {want.numel()} wgrad elements differ from the float32 "
                            f"reduction ({got.dtype})")
    assert_no_problems(problems, tp_world)
