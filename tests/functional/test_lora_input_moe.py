"""The LoRA-A input strategies on a mixture-of-experts GPT on 2 ranks (TP=2 with SP, EP=2, expert TP=1).

The model is Megatron Core's local-spec MoE GPT (``TinyGPTShape(experts=...)``): every layer's MLP is a
top-k router, the allgather token dispatcher and SequentialMLP experts; the expert layout is folded onto
the same two ranks as the dense one, so each rank holds experts/2 of them. LoRA targets linear_qkv,
linear_proj, linear_fc1 and linear_fc2; Bridge's LoRA matches the routed experts' linear_fc1 and
linear_fc2 too (``is_expert_linear``) and gives each local expert an adapter of its own on the expert
tensor-parallel group (here of size 1), with its upstream regather forced off for them.

Eligible adapters are the attention's linear_qkv only (column-parallel, its input is the sequence
shard the base linear gathers). A routed expert's linear_fc1 takes the tokens the dispatcher sent to
that expert, not a sequence-parallel gather: nothing to save, and ``report()`` says why.

Notation: TP size t = 2, sequence s, micro-batch b, hidden h. Each rank computes its own verdicts;
they are all-reduced (MAX) before asserting (``tests.support.dist_checks``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_bridge_ext.levers.lora_input.eligibility import EXPERT_INPUT
from megatron_bridge_ext.measure import SavedActivationMeter
from megatron_bridge_ext.testing import tiny_model as tm
from megatron_bridge_ext.testing import variants
from tests.support.dist_checks import assert_no_problems, local_rel_err, max_over_ranks
from tests.support.lora_blocks import FP32_REL_TOL, _compare, _ddp_like_microbatches, _gpt, _nontrivial, _trainable

pytestmark = [
    pytest.mark.functional,
    pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*CUDA_DEVICE_MAX_CONNECTIONS.*:UserWarning"),
]

TP, EP, ETP, EXPERTS = 2, 2, 1, 4
TOPKS = (1, 2)
UPSTREAM_FLAG = variants.VARIANTS["upstream_regather"].available("lora")[0]
REGATHER_REFERENCE = "upstream_regather" if UPSTREAM_FLAG else "baseline"
"""What regather is bitwise equal to: Bridge's LoRA with its own regather flag (Bridge >= 0.6), else Bridge's
LoRA as shipped, whose gathered path runs the same GEMMs on the same data (as the dense parity tests show)."""
VARIANTS = ("baseline", "regather", "shard_local") + (("upstream_regather",) if UPSTREAM_FLAG else ())
FP64_ACCURACY_RATIO = 2.0
"""Shard-local's error against the float64 model may be at most this multiple of Bridge's fp32 error."""


def _shape(topk: int, **fields) -> tm.TinyGPTShape:
    return tm.TinyGPTShape(experts=EXPERTS, topk=topk, ep=EP, etp=ETP, **fields)


@pytest.fixture(scope="module")
def ep2():
    """Megatron Core's parallel state with TP=2 and EP=2 (expert TP 1) on the 2 ranks; the dense layout after."""
    from megatron.core import parallel_state

    from megatron_bridge_ext.testing import distributed

    distributed.init_from_env(tensor_parallel=TP, expert_parallel=EP, expert_tensor_parallel=ETP)
    yield parallel_state.get_tensor_model_parallel_group()
    distributed.init_from_env(tensor_parallel=TP)


def _expert_paths(shape: tm.TinyGPTShape, surface: str) -> list[str]:
    local = shape.experts // shape.ep
    return [f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{surface}"
            for layer in range(shape.layers) for e in range(local)]


def _attention_paths(shape: tm.TinyGPTShape, surface: str) -> list[str]:
    return [f"decoder.layers.{layer}.self_attention.{surface}" for layer in range(shape.layers)]


def _run(model, shape: tm.TinyGPTShape) -> dict:
    """Per-token loss, the decoder input's grad and every LoRA grad of one forward+backward, and the saved bytes.

    The embedding is frozen; its output is made a leaf that requires grad, so that the gradient reaching
    the bottom of the decoder (through every adapter and expert) is compared as well.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    batch = tm.synthetic_batch(shape)
    captured = {}

    def leaf(module, args, output):
        captured["decoder input"] = output.detach().requires_grad_(True)
        return captured["decoder input"]

    model_parallel_cuda_manual_seed(1000)
    hook = model.embedding.register_forward_hook(leaf)
    try:
        with SavedActivationMeter(model) as meter:
            per_token = model(batch["input_ids"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
    finally:
        hook.remove()
    per_token.mean().backward()
    tensors = {"per-token loss": per_token.detach(), "decoder input grad": captured["decoder input"].grad}
    tensors.update({name: p.grad.detach().clone() if p.grad is not None else None
                    for name, p in _trainable(model).items()})
    return {"tensors": tensors, "saved": meter.result()}


@pytest.fixture(scope="module")
def runs(ep2):
    """Per top-k: each variant's model (fp32) and Bridge's LoRA on the float64 model, built and run once."""
    out = {}
    for topk in TOPKS:
        shape = _shape(topk)
        for variant in VARIANTS:
            model, peft = _gpt(shape, variant)
            out[topk, variant] = {**_run(model, shape), "peft": peft}
        fp64 = dataclasses.replace(shape, dtype="float64")
        out[topk, "float64"] = _run(_gpt(fp64, "baseline")[0], fp64)
    return out


@pytest.mark.parametrize("topk", TOPKS)
def test_bridge_adapts_every_local_expert_and_the_comparison_is_not_of_zeros(ep2, runs, topk):
    """Bridge's LoRA gives each local expert its own linear_fc1 and linear_fc2 adapter; every reference
    tensor (expert adapters' grads included) is non-zero."""
    shape = _shape(topk)
    want = runs[topk, "baseline"]["tensors"]
    surfaces = [p for s in ("linear_qkv", "linear_proj") for p in _attention_paths(shape, s)]
    surfaces += [p for s in ("linear_fc1", "linear_fc2") for p in _expert_paths(shape, s)]
    expected = {f"{p}.adapter.{ab}.weight" for p in surfaces for ab in ("linear_in", "linear_out")}
    problems = _nontrivial(want)
    got = {name for name in want if ".adapter." in name}
    if got != expected:
        problems.append(f"trainable adapters differ: {sorted(got ^ expected)}")
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("topk", TOPKS)
def test_regather_is_bitwise_bridges_lora(ep2, runs, topk):
    got, want = runs[topk, "regather"]["tensors"], runs[topk, REGATHER_REFERENCE]["tensors"]
    assert_no_problems(_compare(got, want, bitwise=True), ep2)


@pytest.mark.parametrize("topk", TOPKS)
def test_shard_local_matches_bridge_and_is_as_accurate_against_float64(ep2, runs, topk):
    """Shard-local sums LoRA-A's partial products over ranks in another order than Bridge: within
    ``FP32_REL_TOL`` (1e-6, 16 fp32 roundings) of Bridge's fp32 LoRA per tensor, and, against the
    same model in float64, its error at most ``FP64_ACCURACY_RATIO`` times Bridge's fp32 error over
    all tensors (max|diff| / max|ref| per tensor, the largest)."""
    got, want, ref = (runs[topk, v]["tensors"] for v in ("shard_local", "baseline", "float64"))
    problems = _compare(got, want, bitwise=False, tol=FP32_REL_TOL)
    ours = max(local_rel_err(got[n], ref[n]) for n in ref)
    bridge = max(local_rel_err(want[n], ref[n]) for n in ref)
    ours, bridge = max_over_ranks(ours, ep2), max_over_ranks(bridge, ep2)
    if not 0 < bridge or ours > FP64_ACCURACY_RATIO * bridge:
        problems.append(f"error against float64: shard_local {ours:.3g}, Bridge fp32 {bridge:.3g}")
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("strategy", ("regather", "shard_local"))
def test_report_names_the_attention_adapters_eligible_and_the_experts_not(ep2, runs, strategy):
    shape = _shape(TOPKS[-1])
    report = {d.adapter: d for d in runs[TOPKS[-1], strategy]["peft"].report()}
    expected = {**dict.fromkeys(_attention_paths(shape, "linear_qkv"), "eligible"),
                **dict.fromkeys(_attention_paths(shape, "linear_proj"), "not a column-parallel"),
                **dict.fromkeys(_expert_paths(shape, "linear_fc1"), EXPERT_INPUT),
                **dict.fromkeys(_expert_paths(shape, "linear_fc2"), "not a column-parallel")}
    problems = []
    if set(report) != set(expected):
        problems.append(f"report lists {sorted(set(report) ^ set(expected))} unlike the model")
    for name, reason in expected.items():
        decision = report.get(name)
        want_strategy = strategy if reason == "eligible" else "off"
        if decision is None or decision.strategy != want_strategy or reason not in decision.reason:
            problems.append(f"{name}: {decision}, expected {want_strategy} ({reason})")
        elif reason == EXPERT_INPUT and "dispatcher" not in decision.retains:
            problems.append(f"{name}: retains {decision.retains!r}, not the dispatched tokens")
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("topk", TOPKS)
def test_shard_local_saves_exactly_the_attention_lora_a_gather(ep2, runs, topk):
    """Baseline minus shard-local saved bytes = eligible adapters x s*b*h*bytes*(1-1/t): each linear_qkv
    LoRA-A keeps the [s/t, b, h] shard instead of Bridge's gathered [s, b, h]; expert adapters unchanged."""
    shape = _shape(topk)
    base, ours = runs[topk, "baseline"]["saved"], runs[topk, "shard_local"]["saved"]
    gathered = shape.seq * shape.micro_batch * shape.hidden * shape.torch_dtype.itemsize
    eligible = _attention_paths(shape, "linear_qkv")
    expected = len(eligible) * (gathered - gathered // TP)
    problems = []
    for name in eligible:
        lora_a = f"{name}.adapter.linear_in"
        if (base.by_module.get(lora_a), ours.by_module.get(lora_a)) != (gathered, gathered // TP):
            problems.append(f"{lora_a}: {base.by_module.get(lora_a)} -> {ours.by_module.get(lora_a)}")
    experts = [f"{p}.adapter.linear_in" for s in ("linear_fc1", "linear_fc2") for p in _expert_paths(shape, s)]
    changed = [n for n in experts if base.by_module.get(n) != ours.by_module.get(n) or not base.by_module.get(n)]
    if changed:
        problems.append(f"expert LoRA-A saves changed or are empty: {changed}")
    drop = base.total_bytes - ours.total_bytes
    if drop != expected:
        problems.append(f"saved bytes dropped by {drop}, expected {len(eligible)} x {gathered} x (1 - 1/{TP}) "
                        f"= {expected}")
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("strategy", ("regather", "shard_local"))
def test_main_grad_accumulates_two_microbatches_like_bridge(ep2, strategy):
    """With fused wgrad accumulation, two microbatches accumulate into ``main_grad`` as in Bridge's LoRA
    (regather against Bridge's upstream regather, bitwise), every adapter (experts' included) on the fused path."""
    shape = _shape(TOPKS[-1])
    reference = REGATHER_REFERENCE if strategy == "regather" else "baseline"
    models = {v: _gpt(shape, v, gradient_accumulation_fusion=True)[0] for v in (reference, strategy)}
    fused = {v: _ddp_like_microbatches(m, shape) for v, m in models.items()}
    want, got = ({n: p.main_grad for n, p in _trainable(models[v]).items()} for v in (reference, strategy))
    problems = _compare(got, want, bitwise=strategy == "regather") + _nontrivial(want)
    problems += [f"{v}: {name} missed the fused wgrad path" for v, flags in fused.items()
                 for name, used in flags.items() if not used]
    assert_no_problems(problems, ep2)
