"""The LoRA-A input strategies on mixture-of-experts GPTs on 2 ranks (TP=2 with SP, EP=2, expert TP=1).

The models are Megatron Core's local-spec MoE GPT (``TinyGPTShape(experts=...)``): a MoE layer's MLP is a
top-k router, the token dispatcher (allgather or all-to-all) and SequentialMLP experts, with a shared-expert
MLP beside them in some cases (``shared_ffn``, overlapped with the dispatcher or not), and some layers dense
(``moe_layer_freq=[0, 1]``). The expert layout is folded onto the same two ranks as the dense one, so each
rank holds experts/2 of them. Each case runs Bridge's PEFT of one kind (LoRA, DoRA, CanonicalLoRA) as shipped,
with Bridge's own regather flag where it has one, and ours with ``regather`` and ``shard_local``, all on the
same weights and data, and Bridge's PEFT on the same model in float64; each model is built and run once per
module (``runs``).

Bridge adapts each local routed expert's linear_fc1 and linear_fc2 with an adapter of its own on the expert
tensor-parallel group (here of size 1), with its upstream regather forced off for them
(``is_expert_linear``); ``share_expert_adapters`` concerns grouped experts only (Transformer Engine's), and
changes nothing on SequentialMLP experts. Bridge's DoRA builds expert adapters on the dense TP group (it does
not pass ``is_expert``), whose LoRA-B does not fit an expert weight when expert TP differs from TP (here
1 vs 2): Bridge itself fails, so the DoRA case adapts the attention, dense and shared-expert layers only.

Eligible adapters: every layer's attention linear_qkv, a dense layer's linear_fc1 and a shared expert's
linear_fc1 (column-parallel linears that gather their sequence-sharded input). Not eligible: a routed
expert's linear_fc1 (its input is the tokens the dispatcher sent to that expert, not a sequence-parallel
gather) and an overlapped shared expert's linear_fc1 (Core switches its linear's communication off and the
dispatcher hands it the gathered input). ``report()`` says which and why.

Notation: TP size t = 2, sequence s, micro-batch b, hidden h, e bytes per element. Each rank computes its own
verdicts; they are all-reduced (MAX) before asserting (``tests.support.dist_checks``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

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
STRATEGIES = ("regather", "shard_local")
FP64_ACCURACY_RATIO = 2.0
"""Shard-local's error against the float64 model may be at most this multiple of Bridge's fp32 error."""
SHARED_FFN = 32
MIXED = dict(moe_layer_freq=[0, 1], shared_ffn=SHARED_FFN)
"""A dense first layer, then an MoE layer with a shared expert."""
DORA_TARGETS = ["linear_qkv", "linear_proj", "*.mlp.linear_fc1", "*.mlp.linear_fc2", "*.shared_experts.linear_fc1",
                "*.shared_experts.linear_fc2"]
"""Every layer Bridge's DoRA can adapt here: all but the routed experts (see the module docstring)."""

NOT_COLUMN_PARALLEL = "not a column-parallel"
NO_SP_COMM = "does no sequence-parallel communication"
ELIGIBLE = "eligible"
SPLIT = {"linear_qkv": ("adapter_q", "adapter_k", "adapter_v"), "linear_fc1": ("adapter_up", "adapter_gate")}
"""CanonicalLoRA's adapters of the fused layers."""


@dataclass(frozen=True)
class Case:
    """One MoE model and PEFT kind."""

    name: str
    kind: str = "lora"
    fields: dict = field(default_factory=dict)

    def shape(self, **extra) -> tm.TinyGPTShape:
        targets = {"lora_targets": DORA_TARGETS} if self.kind == "dora" else {}
        return tm.TinyGPTShape(experts=EXPERTS, ep=EP, etp=ETP, peft=self.kind, swiglu=self.kind == "canonical_lora",
                               **targets, **self.fields, **extra)

    @property
    def upstream_flag(self) -> bool:
        return variants.VARIANTS["upstream_regather"].available(self.kind)[0]

    @property
    def regather_reference(self) -> str:
        """What regather is bitwise equal to: Bridge's PEFT with its own regather flag (Bridge >= 0.6, LoRA), else
        Bridge's PEFT as shipped, whose gathered path runs the same GEMMs on the same data."""
        return "upstream_regather" if self.upstream_flag else "baseline"

    @property
    def variants(self) -> tuple[str, ...]:
        return ("baseline", *STRATEGIES) + (("upstream_regather",) if self.upstream_flag else ())


CASES = [
    Case("allgather top-1", fields=dict(dispatcher="allgather", topk=1)),
    Case("allgather top-2", fields=dict(dispatcher="allgather", topk=2)),
    Case("alltoall top-1", fields=dict(dispatcher="alltoall", topk=1)),
    Case("alltoall top-2", fields=dict(dispatcher="alltoall", topk=2)),
    Case("allgather dense+MoE shared expert", fields=dict(dispatcher="allgather", topk=2, **MIXED)),
    Case("alltoall dense+MoE shared expert", fields=dict(dispatcher="alltoall", topk=2, **MIXED)),
    Case("alltoall dense+MoE overlapped shared expert",
         fields=dict(dispatcher="alltoall", topk=2, shared_overlap=True, **MIXED)),
    Case("DoRA alltoall dense+MoE shared expert", kind="dora", fields=dict(dispatcher="alltoall", topk=2, **MIXED)),
    Case("CanonicalLoRA alltoall dense+MoE shared expert", kind="canonical_lora",
         fields=dict(dispatcher="alltoall", topk=2, **MIXED)),
]
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def ep2():
    """Megatron Core's parallel state with TP=2 and EP=2 (expert TP 1) on the 2 ranks; the dense layout after."""
    from megatron.core import parallel_state

    from megatron_bridge_ext.testing import distributed

    distributed.init_from_env(tensor_parallel=TP, expert_parallel=EP, expert_tensor_parallel=ETP)
    yield parallel_state.get_tensor_model_parallel_group()
    distributed.init_from_env(tensor_parallel=TP)


# ------------------------------------------------------------------------------------ the adapters of a case


def _layout(case: Case, shape: tm.TinyGPTShape) -> dict[str, str]:
    """Every adapted layer's path and what ``report()`` must say about it (a reason fragment, or ELIGIBLE)."""
    moe = set(tm.moe_layers(shape))
    out = {}
    for layer in range(shape.layers):
        prefix = f"decoder.layers.{layer}"
        out[f"{prefix}.self_attention.linear_qkv"] = ELIGIBLE
        out[f"{prefix}.self_attention.linear_proj"] = NOT_COLUMN_PARALLEL
        if layer not in moe:
            out.update({f"{prefix}.mlp.linear_fc1": ELIGIBLE, f"{prefix}.mlp.linear_fc2": NOT_COLUMN_PARALLEL})
            continue
        if shape.shared_ffn:
            out[f"{prefix}.mlp.shared_experts.linear_fc1"] = NO_SP_COMM if shape.shared_overlap else ELIGIBLE
            out[f"{prefix}.mlp.shared_experts.linear_fc2"] = NOT_COLUMN_PARALLEL
        if case.kind != "dora":
            for e in range(shape.experts // shape.ep):
                out[f"{prefix}.mlp.experts.local_experts.{e}.linear_fc1"] = EXPERT_INPUT
                out[f"{prefix}.mlp.experts.local_experts.{e}.linear_fc2"] = NOT_COLUMN_PARALLEL
    return out


def _adapters(case: Case, layer: str) -> list[tuple[str, str]]:
    """(name in ``report()``, LoRA-A module path) of each adapter of an adapted layer."""
    keys = SPLIT.get(layer.rsplit(".", 1)[-1], ()) if case.kind == "canonical_lora" else ()
    return [(f"{layer}.{key}", f"{layer}.adapter.{key}.linear_in") for key in keys] or [
        (layer, f"{layer}.adapter.linear_in")]


DISPATCHERS = {"allgather": "MoEAllGatherTokenDispatcher", "alltoall": "MoEAlltoAllTokenDispatcher"}


def _model_problems(shape: tm.TinyGPTShape, modules: dict) -> list[str]:
    """The model is the case's: its dispatcher, its dense and MoE layers, its shared experts."""
    problems = []
    for layer in range(shape.layers):
        mlp = modules[f"decoder.layers.{layer}.mlp"]
        moe = layer in tm.moe_layers(shape)
        want = {"mlp": "MoELayer" if moe else "MLP", "dispatcher": DISPATCHERS[shape.dispatcher] if moe else None,
                "shared experts": "SharedExpertMLP" if moe and shape.shared_ffn else None}
        parts = {"mlp": mlp, "dispatcher": getattr(mlp, "token_dispatcher", None),
                 "shared experts": getattr(mlp, "shared_experts", None)}
        got = {part: type(obj).__name__ if obj is not None else None for part, obj in parts.items()}
        if got != want:
            problems.append(f"layer {layer}: {got}, expected {want}")
    return problems


def _is_routed_expert(layer: str) -> bool:
    return ".local_experts." in layer


def _trainable_per_adapter(kind: str) -> tuple[str, ...]:
    """The parameters of one adapter: LoRA-A and LoRA-B, and DoRA's magnitude vector."""
    return ("linear_in.weight", "linear_out.weight") + (("weight_magnitude",) if kind == "dora" else ())


# ------------------------------------------------------------------------------------------------- the runs


def _run(model, shape: tm.TinyGPTShape) -> dict:
    """Per-token loss, the decoder input's grad and every adapter grad of one forward+backward, and the saved bytes.

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
    return {"tensors": tensors, "saved": meter.result(), "modules": dict(model.named_modules())}


class _Runs:
    """Each case's variants (fp32) and Bridge's PEFT on the float64 model, run on first use and kept."""

    def __init__(self):
        self._runs = {}

    def __call__(self, case: Case) -> dict:
        if case.name not in self._runs:
            shape = case.shape()
            out = {}
            for variant in case.variants:
                model, peft = _gpt(shape, variant)
                out[variant] = {**_run(model, shape), "peft": peft}
            fp64 = dataclasses.replace(shape, dtype="float64")
            out["float64"] = _run(_gpt(fp64, "baseline")[0], fp64)
            self._runs[case.name] = out
        return self._runs[case.name]


@pytest.fixture(scope="module")
def runs(ep2):
    return _Runs()


# ------------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bridge_adapts_the_expected_layers_and_the_comparison_is_not_of_zeros(ep2, runs, case):
    """Bridge's PEFT adapts every targeted layer (each local routed expert with an adapter of its own, the shared
    expert, the dense layer) with exactly its adapters' parameters; every reference tensor is non-zero."""
    shape = case.shape()
    want = runs(case)["baseline"]["tensors"]
    expected = set()
    for layer in _layout(case, shape):
        keys = [key for key, _ in _adapters(case, layer)]
        prefixes = [f"{layer}.adapter"] if keys == [layer] else [f"{layer}.adapter.{k.rsplit('.', 1)[-1]}" for k in keys]
        expected |= {f"{p}.{param}" for p in prefixes for param in _trainable_per_adapter(case.kind)}
    problems = _nontrivial(want) + _model_problems(shape, runs(case)["baseline"]["modules"])
    got = {name for name in want if ".adapter." in name}
    if got != expected:
        problems.append(f"trainable adapters differ: {sorted(got ^ expected)}")
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_regather_is_bitwise_bridges_peft(ep2, runs, case):
    got, want = runs(case)["regather"]["tensors"], runs(case)[case.regather_reference]["tensors"]
    assert_no_problems(_compare(got, want, bitwise=True), ep2)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_shard_local_matches_bridge_and_is_as_accurate_against_float64(ep2, runs, case):
    """Shard-local sums LoRA-A's partial products over ranks in another order than Bridge: within
    ``FP32_REL_TOL`` (1e-6, 16 fp32 roundings) of Bridge's fp32 PEFT per tensor, and, against the
    same model in float64, its error at most ``FP64_ACCURACY_RATIO`` times Bridge's fp32 error over
    all tensors (max|diff| / max|ref| per tensor, the largest)."""
    got, want, ref = (runs(case)[v]["tensors"] for v in ("shard_local", "baseline", "float64"))
    problems = _compare(got, want, bitwise=False, tol=FP32_REL_TOL)
    ours = max(local_rel_err(got[n], ref[n]) for n in ref)
    bridge = max(local_rel_err(want[n], ref[n]) for n in ref)
    ours, bridge = max_over_ranks(ours, ep2), max_over_ranks(bridge, ep2)
    if not 0 < bridge or ours > FP64_ACCURACY_RATIO * bridge:
        problems.append(f"error against float64: shard_local {ours:.3g}, Bridge fp32 {bridge:.3g}")
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_report_names_each_adapter_eligible_or_why_not(ep2, runs, case, strategy):
    shape = case.shape()
    report = {d.adapter: d for d in runs(case)[strategy]["peft"].report()}
    expected = {name: reason for layer, reason in _layout(case, shape).items() for name, _ in _adapters(case, layer)}
    problems = []
    if set(report) != set(expected):
        problems.append(f"report lists {sorted(set(report) ^ set(expected))} unlike the model")
    for name, reason in expected.items():
        decision = report.get(name)
        want_strategy = strategy if reason == ELIGIBLE else "off"
        if decision is None or decision.strategy != want_strategy or reason not in decision.reason:
            problems.append(f"{name}: {decision}, expected {want_strategy} ({reason})")
        elif reason == EXPERT_INPUT and "dispatcher" not in decision.retains:
            problems.append(f"{name}: retains {decision.retains!r}, not the dispatched tokens")
        elif reason == ELIGIBLE and ".shared_experts." in name and "router" not in decision.retains:
            problems.append(f"{name}: retains {decision.retains!r}, not the router's shard")
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_saving_is_exactly_the_eligible_lora_a_gathers(ep2, runs, case, strategy):
    """Per eligible LoRA-A, Bridge's gathered [s, b, h] input against our [s/t, b, h] shard; every other LoRA-A
    (routed experts', row-parallel ones, an overlapped shared expert's) saves what Bridge's saves.

    Bridge's LoRA-A each keep their own gathered copy; ours keep the shard, the base linear's input, one storage
    for all adapters of the layer (CanonicalLoRA's q, k, v and up, gate). For linear_qkv and a dense linear_fc1
    nothing else holds that shard (the norm before them saves its input, not its output): per adapted layer with
    n adapters the total drops by s*b*h*e*(n - 1/t), with LoRA s*b*h*e*(1 - 1/t). A shared expert's input is the
    MoE layer's input, which Core's router already keeps for its own backward (``RouterGatingLinearFunction``
    saves its input, moe_utils.py:1319): the shard adds nothing, and the drop is s*b*h*e*n."""
    shape = case.shape()
    base, ours = runs(case)["baseline"]["saved"], runs(case)[strategy]["saved"]
    gathered = shape.seq * shape.micro_batch * shape.hidden * shape.torch_dtype.itemsize
    shard = gathered // TP
    layout = _layout(case, shape)
    problems, expected = [], 0
    for layer, reason in layout.items():
        adapters = [path for _, path in _adapters(case, layer)]
        if reason == ELIGIBLE:
            expected += len(adapters) * gathered - (0 if ".shared_experts." in layer else shard)
            want = {path: (gathered, shard) for path in adapters}
        else:
            want = {path: (base.by_module.get(path), base.by_module.get(path)) for path in adapters}
        for path, (before, after) in want.items():
            if (base.by_module.get(path), ours.by_module.get(path)) != (before, after) or not before:
                problems.append(f"{path}: {base.by_module.get(path)} -> {ours.by_module.get(path)}, "
                                f"expected {before} -> {after}")
    drop = base.total_bytes - ours.total_bytes
    if drop != expected:
        problems.append(f"saved bytes dropped by {drop}, expected the sum over eligible layers of n x {gathered} "
                        f"(- {shard} where the shard is new) = {expected}")
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", [c for c in CASES if c.kind != "dora"], ids=[c.name for c in CASES if c.kind != "dora"])
def test_routed_expert_adapters_stay_bridges(ep2, runs, case, strategy):
    """Every routed expert's wrapper and adapters are the classes Bridge builds, with the same sub-modules and
    the same settings (every plain attribute: flags, sizes, names), and no strategy of ours runs in them; with
    regather even their gradients are bitwise Bridge's (above)."""
    ours, base = runs(case)[strategy]["modules"], runs(case)["baseline"]["modules"]
    experts = [name for name in base if _is_routed_expert(name) and ".adapter" in name]
    problems = [] if experts else ["no routed expert adapter in the model"]
    for name in experts:
        if type(ours.get(name)) is not type(base[name]):
            problems.append(f"{name}: {type(ours.get(name)).__name__}, Bridge builds {type(base[name]).__name__}")
        elif _settings(ours[name]) != _settings(base[name]):
            problems.append(f"{name}: settings {_settings(ours[name])}, Bridge's {_settings(base[name])}")
    for name, module in ours.items():
        if _is_routed_expert(name) and type(module).__module__.startswith("megatron_bridge_ext"):
            problems.append(f"{name}: {type(module).__module__}.{type(module).__name__} is ours")
    assert_no_problems(problems, ep2)


def _settings(module) -> dict:
    """A module's plain attributes (bools, numbers, strings, None): what a strategy would set to change its path."""
    return {k: v for k, v in vars(module).items() if isinstance(v, (bool, int, float, str, type(None)))}


def test_share_expert_adapters_builds_the_same_adapters_on_sequential_experts(ep2):
    """``share_expert_adapters`` applies to grouped experts only: SequentialMLP experts get one adapter each
    with it on or off, so the cases above cover both settings."""
    from megatron_bridge_ext.peft import kinds

    shape = Case("alltoall", fields=dict(dispatcher="alltoall")).shape()
    names = {}
    for share in (True, False):
        peft = kinds.bridge_class("lora")(**tm.peft_fields(shape), share_expert_adapters=share)
        model = tm.apply_peft(tm.build_gpt(shape), peft)
        names[share] = sorted(n for n, p in model.named_parameters() if p.requires_grad and _is_routed_expert(n))
    problems = [] if names[True] and names[True] == names[False] else [f"adapters differ: {names}"]
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_main_grad_accumulates_two_microbatches_like_bridge(ep2, case, strategy):
    """With fused wgrad accumulation, two microbatches accumulate into ``main_grad`` as with Bridge's PEFT
    (regather bitwise its reference, shard_local within 1e-6), every LoRA-A and LoRA-B (experts' included) on the
    fused path; DoRA's magnitude vector is a plain parameter, whose grad DDP adds to main_grad itself."""
    shape = case.shape()
    reference = case.regather_reference if strategy == "regather" else "baseline"
    models = {v: _gpt(shape, v, gradient_accumulation_fusion=True)[0] for v in (reference, strategy)}
    fused = {v: _ddp_like_microbatches(m, shape) for v, m in models.items()}
    want, got = ({n: p.main_grad for n, p in _trainable(models[v]).items()} for v in (reference, strategy))
    problems = _compare(got, want, bitwise=strategy == "regather") + _nontrivial(want)
    problems += [f"{v}: {name} missed the fused wgrad path" for v, flags in fused.items()
                 for name, used in flags.items() if not used and not name.endswith("weight_magnitude")]
    assert_no_problems(problems, ep2)


@pytest.mark.parametrize("module", ["shared_experts", "moe"])
def test_a_recomputed_shared_expert_refuses_regather_and_keeps_shard_local(ep2, module):
    """Selective 'shared_experts' or 'moe' recompute puts the shared expert's MLP in a checkpoint (Core's
    moe_layer.py): regather leaves its linear_fc1 to Bridge and says why, shard_local keeps it, and under that
    recompute both match Bridge's LoRA (regather bitwise, shard_local within 1e-6). The dense layer's
    linear_fc1, outside the checkpoint, keeps both strategies."""
    case = next(c for c in CASES if c.name == "alltoall dense+MoE shared expert")
    shape = case.shape()
    recompute = dict(recompute_granularity="selective", recompute_modules=[module])
    built = {v: _gpt(shape, v, **recompute) for v in ("baseline", *STRATEGIES)}
    tensors = {v: _run(model, shape)["tensors"] for v, (model, _) in built.items()}
    shared, dense = "decoder.layers.1.mlp.shared_experts.linear_fc1", "decoder.layers.0.mlp.linear_fc1"
    problems = []
    for strategy in STRATEGIES:
        report = {d.adapter: d for d in built[strategy][1].report()}
        refused = strategy == "regather"
        if (report[shared].strategy == "off") != refused or (refused and f"'{module}' recompute" not in
                                                            report[shared].reason):
            problems.append(f"{strategy}: {report[shared].describe()}")
        if report[dense].strategy != strategy:
            problems.append(f"{strategy}: {report[dense].describe()}")
        problems += _compare(tensors[strategy], tensors["baseline"], bitwise=refused)
    assert_no_problems(problems + _nontrivial(tensors["baseline"]), ep2)
