"""Fine-grained activation offloading in the estimate: the groups Core's interface opens, traced on Core's real tiny
model (what leaves the count equals what the saved-tensor meter counts for the modules inside the groups), the bytes
of the fake trace from the shapes, and the steady state's policy against Core's ``post_warmup_callback``.

The tiny model: h 64, 4 heads of 16, 2 KV heads, sequence 32, micro-batch 2, 2 layers, fp32 (4 B per element)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate import phases
from megatron_bridge_ext.estimate.features import activation_offload
from megatron_bridge_ext.estimate.features.activation_offload import Group

pytestmark = [pytest.mark.unit]

SEQ, BATCH, H, HEADS, KV, LAYERS, E = 32, 2, 64, 4, 2, 2, 4
D = H // HEADS
GROUP_MODULES = ("self_attention.core_attention", "self_attention.linear_proj")
"""The modules Core runs inside the ``core_attn`` and ``attn_proj`` groups (attention.py L1555-1565, L1615-1617)."""


def _shape():
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

    return TinyGPTShape(tp=1, sequence_parallel=False, layers=LAYERS, hidden=H, heads=HEADS, kv_heads=KV, seq=SEQ,
                        micro_batch=BATCH)


OFFLOAD = dict(fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj"])


def _in_group(module: str) -> str:
    parts = module.split(".")
    return "group" if ".".join(parts[3:5]) in GROUP_MODULES else "other"


def _measured(offload: bool):
    """One forward of Core's real tiny GPTModel (local spec) on CPU tensors under the meter, modules inside the
    groups classified apart; with ``offload`` under :func:`activation_offload.recording`, every tensor admitted
    (min_offloaded_tensor_size 0)."""
    result, groups, _ = _run(_shape(), dict(OFFLOAD, min_offloaded_tensor_size=0) if offload else {}, _in_group,
                             offload)
    return result, groups


def _run(shape, fields: dict, classify, offload: bool):
    """One forward and backward of Core's real tiny GPTModel of ``shape`` and model ``fields`` on CPU tensors under
    the meter (modules classified by ``classify``), with ``offload`` under :func:`activation_offload.recording`: the
    meter's result, the groups and the parameters' gradients."""
    import contextlib

    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.measure import SavedActivationMeter
    from megatron_bridge_ext.testing import tiny_model

    with fake_parallel_world(tp=1, pp=1, cp=1, rank=0, device="cpu"):
        model = tiny_model.build_gpt(shape, **fields)
        batch = {name: tensor.contiguous() for name, tensor in tiny_model.synthetic_batch(shape).items()}
        with SavedActivationMeter(model, classifier=classify) as meter, \
                (activation_offload.recording(model) if offload else contextlib.nullcontext()) as recorder:
            loss = tiny_model.loss_of(model, batch)
        result = meter.result()
        groups = recorder.result(meter.counted) if offload else ()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
    return result, groups, grads


def test_what_leaves_the_count_is_what_the_meter_counts_for_the_modules_in_the_groups():
    plain, _ = _measured(offload=False)
    offloaded, groups = _measured(offload=True)
    assert plain.by_category["group"] > 0
    assert [(g.name, g.layer) for g in groups] == [(n, layer) for layer in range(LAYERS)
                                                   for n in ("core_attn", "attn_proj")]
    assert offloaded.by_category.get("group", 0) == 0
    assert plain.total_bytes - offloaded.total_bytes == plain.by_category["group"]
    assert activation_offload.gpu_bytes(groups) == plain.by_category["group"]


def _estimate(**fields):
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    cfg = tiny_config(_shape(), **fields)
    cfg.model.transformer_impl = "transformer_engine"  # Bridge offloads only then; the trace builds the local spec
    return estimate(cfg, attention="fused", transformer_impl="local", device="cpu")


@pytest.fixture(scope="module")
def estimates():
    k = SEQ * BATCH * KV * D  # the smallest of q, k, v and the output: the fused kernel's fp32 lse [b, heads, s] stays
    return _estimate(), _estimate(**OFFLOAD, min_offloaded_tensor_size=k)


def _attention(est) -> int:
    return next(c.bytes for c in est.components if c.name == "attention")


def test_the_fake_trace_offloads_q_k_v_and_the_output_of_each_layer(estimates):
    """The fused kernel's q [s, b, heads, d], k and v [s, b, kv, d] and output [s, b, h] (estimate/standins.py
    L35-50); attn_proj saves that same output again, so it frees nothing more."""
    plain, offloaded = estimates
    per_layer = SEQ * BATCH * (HEADS * D + 2 * KV * D + H) * E
    assert _attention(plain) - _attention(offloaded) == LAYERS * per_layer


def test_the_steady_state_keeps_the_last_layers_groups_and_iteration_one_does_not(estimates):
    """One microbatch in flight, fraction 1: the first backward chunk keeps its last group of each name (its last
    layer's q, k, v and output), the warmup iteration offloads them too."""
    _, offloaded = estimates
    per_layer = SEQ * BATCH * (HEADS * D + 2 * KV * D + H) * E
    parts = {c.name: c.bytes for c in offloaded.components}
    assert parts[activation_offload.KEPT] == per_layer
    assert parts[activation_offload.IN_FLIGHT_COPY] == per_layer
    by_name = {p.name: p for p in phases.phases(offloaded)}
    assert activation_offload.KEPT not in {c.name for c in by_name[phases.ITERATION_1].components}
    assert activation_offload.KEPT in {c.name for c in by_name[phases.STEADY].components}


def _groups(layers: int, names=("core_attn", "attn_proj"), host: int = 8):
    return tuple(Group(name, layer, (((layer, name), 8),), host) for layer in range(layers) for name in names)


@pytest.mark.parametrize("fraction, first, kept", [
    (1.0, False, []),
    (1.0, True, [(3, "core_attn"), (3, "attn_proj")]),
    (0.5, False, [(2, "core_attn"), (2, "attn_proj"), (3, "core_attn"), (3, "attn_proj")]),
    # the last of each name first, then int(6 x 0.5) = 3 of the 6 left, the latest ones
    (0.5, True, [(1, "attn_proj"), (2, "core_attn"), (2, "attn_proj"), (3, "core_attn"), (3, "attn_proj")]),
    (0.0, False, [(layer, name) for layer in range(4) for name in ("core_attn", "attn_proj")]),
])
def test_the_steady_state_policy_is_cores_post_warmup_callback(fraction, first, kept):
    out = activation_offload.kept(_groups(4), fraction, first_backward=first)
    assert [(g.layer, g.name) for g in out] == kept


def test_a_group_without_bytes_is_not_counted_against_the_fraction():
    """Core counts only groups with offloaded bytes (fine_grained_activation_offload.py L614-618)."""
    empty = tuple(Group("mlp_norm", layer, (), 0) for layer in range(4))
    out = activation_offload.kept(_groups(2, names=("core_attn",)) + empty, 0.5, first_backward=False)
    assert [(g.layer, g.name) for g in out] == [(1, "core_attn")]


def test_a_storage_two_groups_save_stays_while_either_group_stays():
    shared = Group("core_attn", 0, ((("s",), 8),), 8), Group("attn_proj", 0, ((("s",), 8),), 8)
    assert activation_offload.gpu_bytes(shared) == 8
    assert activation_offload.gpu_bytes(activation_offload.kept(shared, 0.5, first_backward=False)) == 8


def test_the_host_bytes_count_the_output_in_both_groups(estimates):
    """Core copies each group's tensors (fine_grained_activation_offload.py L1002-1026): core_attn's output once for
    core_attn and again for attn_proj; the step-time model sends these bytes over the host link."""
    _, offloaded = estimates
    per_layer = SEQ * BATCH * (HEADS * D + 2 * KV * D + H + H) * E
    assert offloaded.offload_host_bytes == LAYERS * per_layer


@pytest.mark.parametrize("fields, setting", [
    (dict(offload_modules=["fused_group_mlp"], num_moe_experts=8), "model.offload_modules"),
    (dict(offload_modules=["expert_fc1"], num_moe_experts=8, moe_grouped_gemm=True, fp8="hybrid"),
     "model.offload_modules"),
    (dict(offload_modules=["core_attn"], pipeline_model_parallel_size=2, delta_offload_bytes_across_pp_ranks=1),
     "model.delta_offload_bytes_across_pp_ranks"),
])
def test_what_the_estimate_does_not_model_is_refused_by_name(fields, setting):
    from types import SimpleNamespace

    model = SimpleNamespace(**dict(dict(fine_grained_activation_offloading=True, num_moe_experts=None,
                                        pipeline_model_parallel_size=1, delta_offload_bytes_across_pp_ranks=0), **fields))
    assert [f.setting for f in activation_offload.findings(model)] == [setting]
    model.fine_grained_activation_offloading = False
    assert activation_offload.findings(model) == []


def test_the_experts_groups_on_bf16_grouped_gemm_experts_are_modelled():
    """expert_fc1 and moe_act in bf16 are traced (:mod:`..expert_offload`); without moe_grouped_gemm Core's
    SequentialMLP opens no group (transformer_engine_spec_provider.py L75-85): nothing to refuse either."""
    from types import SimpleNamespace

    for grouped in (True, False):
        model = SimpleNamespace(fine_grained_activation_offloading=True, num_moe_experts=8, moe_grouped_gemm=grouped,
                                offload_modules=["expert_fc1", "moe_act"], pipeline_model_parallel_size=1)
        assert activation_offload.findings(model) == []


# The routed experts' groups (expert_fc1, moe_act): a tiny MoE model, swiglu with Core's fused weighted swiglu.
EXPERTS, TOPK, MOE_FFN = 4, 2, 48
ROUTED = SEQ * BATCH * TOPK
"""The tokens the local experts receive per microbatch (one rank, no token dropping)."""
EXPERT_GROUPS = dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1", "moe_act"],
                     moe_grouped_gemm=True, bias_activation_fusion=True)


def _moe_shape(**fields):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

    return TinyGPTShape(tp=1, sequence_parallel=False, layers=LAYERS, hidden=H, heads=HEADS, kv_heads=KV, seq=SEQ,
                        micro_batch=BATCH, experts=EXPERTS, topk=TOPK, moe_ffn=MOE_FFN, swiglu=True, **fields)


def _expert_part(module: str) -> str:
    """What a module of Core's local SequentialMLP is: an expert's ``linear_fc1`` or ``linear_fc2``, or the expert
    (``decoder.layers.N.mlp.experts.local_experts.E``: its activation), else ``other``."""
    parts = module.split(".")
    if "local_experts" not in parts:
        return "other"
    return "activation" if parts[-2] == "local_experts" else parts[-1]


def _measured_experts(offload: bool, **extra):
    """One forward and backward of Core's real tiny MoE GPTModel (local spec, SequentialMLP experts) on CPU under the
    meter; with ``offload`` under :func:`activation_offload.recording`, every tensor admitted. Returns the meter's
    result, the groups and the parameters' gradients."""
    fields = dict(EXPERT_GROUPS, min_offloaded_tensor_size=0) if offload else dict(bias_activation_fusion=True)
    return _run(_moe_shape(), {**fields, **extra}, _expert_part, offload)


def test_the_experts_groups_hold_what_cores_experts_save_for_fc1_and_the_activation():
    """Core's real SequentialMLP measured by the meter: what its experts' linear_fc1 (their inputs) and activations
    saved leaves the count, in one expert_fc1 and one moe_act group per layer; linear_fc2's input stays
    (experts.py L792-900). The grouped run computes the same gradients."""
    plain, _, plain_grads = _measured_experts(offload=False)
    offloaded, groups, grads = _measured_experts(offload=True)
    assert [(g.name, g.layer) for g in groups] == [(n, layer) for layer in range(LAYERS)
                                                   for n in ("expert_fc1", "moe_act")]
    by_name = {name: activation_offload.gpu_bytes([g for g in groups if g.name == name])
               for name in ("expert_fc1", "moe_act")}
    assert by_name == {"expert_fc1": plain.by_category["linear_fc1"], "moe_act": plain.by_category["activation"]}
    assert plain.total_bytes - offloaded.total_bytes == sum(by_name.values())
    assert offloaded.by_category.get("other") == plain.by_category["other"] + plain.by_category["linear_fc2"]
    assert all(a.allclose(b) for a, b in zip(plain_grads, grads))


def test_the_experts_groups_bytes_follow_from_the_routed_tokens():
    """Per layer: expert_fc1 the experts' whole input [routed, h] (TE keeps it whole under save_original_input,
    grouped_linear.py L623-626); moe_act the fused weighted swiglu's input [routed, 2 x ffn] and the probabilities
    [routed, 1] in fp32 (fused_bias_swiglu.py L191-199)."""
    _, groups, _ = _measured_experts(offload=True)
    assert [g.host_bytes for g in groups] == [ROUTED * H * E, ROUTED * (2 * MOE_FFN + 1) * E] * LAYERS


def test_under_moe_act_recompute_the_group_holds_the_checkpoints_inputs_and_fc2s_input_is_released():
    """TEGroupedMLP checkpoints the activation inside the moe_act group (experts.py L880-886): the group holds the
    checkpoint's inputs, fc1's output [routed, 2 x ffn] and the probabilities, and fc2's input, the checkpoint's
    output, is released (L892-893): nothing of the experts stays."""
    plain, _, _ = _measured_experts(offload=False)
    offloaded, groups, _ = _measured_experts(offload=True, recompute_granularity="selective",
                                             recompute_modules=["moe_act"])
    assert [g.host_bytes for g in groups] == [ROUTED * H * E, ROUTED * (2 * MOE_FFN + 1) * E] * LAYERS
    assert offloaded.by_category == {"other": plain.by_category["other"]}


def _moe_estimate(**fields):
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    cfg = tiny_config(_moe_shape(), **fields)
    cfg.model.transformer_impl = "transformer_engine"
    return estimate(cfg, attention="fused", transformer_impl="local", device="cpu")


def test_the_fake_trace_offloads_the_experts_whole_inputs_and_activation_inputs():
    """Core checks min_offloaded_tensor_size per tensor (fine_grained_activation_offload.py L986-1000): at one
    expert's share of fc1's input plus one element, only TEGroupedMLP's whole tensors pass, fc1's input
    [routed, h] and the activation's input [routed, 2 x ffn]; the probabilities [routed, 1] stay."""
    minimum = ROUTED // EXPERTS * H + 1
    plain = _moe_estimate(bias_activation_fusion=True)
    offloaded = _moe_estimate(**EXPERT_GROUPS, min_offloaded_tensor_size=minimum)
    per_layer = ROUTED * (H + 2 * MOE_FFN) * E
    assert offloaded.offload_host_bytes == LAYERS * per_layer
    assert _experts(plain) - _experts(offloaded) == LAYERS * per_layer
    parts = {c.name: c.bytes for c in offloaded.components}
    assert parts[activation_offload.IN_FLIGHT_COPY] == ROUTED * 2 * MOE_FFN * E  # moe_act's, the larger group
    assert parts[activation_offload.KEPT] == per_layer  # the last layer's groups, one microbatch in flight


def _experts(est) -> int:
    return next(c.bytes for c in est.components if c.name == "experts")
