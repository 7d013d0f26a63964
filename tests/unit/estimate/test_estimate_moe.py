"""The memory estimate of mixture-of-experts models (Qwen3-MoE's shape, shrunk), against hand computation.

Expert weights, expert adapters and their optimizer sharding are recomputed from the shape fields with
Megatron Core's expert-parallel rules (a rank builds experts / EP experts; the distributed optimizer
divides expert state over DP x TP x CP / (EP x ETP) ranks); the routed load is checked through what it
scales (the experts' saved activations and the backward transient) and what it leaves alone.
"""

from __future__ import annotations

import math
import os

import pytest

from megatron_bridge_ext.estimate import configs, memory
from megatron_bridge_ext.estimate.trace import ATTENTION, EXPERTS, LOGITS_LOSS, MLP, MOE_DISPATCH, NORMS
from megatron_bridge_ext.findings import Refused
from tests.support.estimate import DATA

pytestmark = [pytest.mark.unit]

QWEN3_30B_A3B = os.path.join(DATA, "qwen3-30b-a3b", "config.json")
BF16 = 2
H, FFN, MOE_FFN, EXPERTS_N, TOPK, HEADS, GROUPS, HEAD_DIM, VOCAB = 128, 256, 64, 8, 2, 8, 4, 16, 1024
SEQ, RANK = 128, 8


def _tiny(*, tp=2, ep=4, dp=4, layers=3, peft="lora", dispatcher="alltoall", extra=()):
    """Qwen3-MoE's config.json shrunk: SwiGLU experts, top-2 of 8, q/k norms, untied embeddings."""
    layout = configs.Layout(tp=tp, ep=ep, dp=dp, seq=SEQ, peft=peft, lora_dim=RANK, lora_alpha=RANK)
    overrides = [f"model.num_layers={layers}", f"model.hidden_size={H}", f"model.ffn_hidden_size={FFN}",
                 f"model.moe_ffn_hidden_size={MOE_FFN}", f"model.num_moe_experts={EXPERTS_N}",
                 f"model.moe_router_topk={TOPK}", f"model.num_attention_heads={HEADS}",
                 f"model.num_query_groups={GROUPS}", f"model.kv_channels={HEAD_DIM}", f"model.vocab_size={VOCAB}",
                 f"model.moe_token_dispatcher_type={dispatcher}", *extra]
    return configs.from_hf_config(QWEN3_30B_A3B, layout, overrides)


def _expert_params(layers: int, local: int) -> int:
    """Routed experts of one rank (ETP 1): per expert, fc1 [2 x moe_ffn, h] (SwiGLU) and fc2 [h, moe_ffn]."""
    return layers * local * (2 * MOE_FFN * H + MOE_FFN * H)


def _expert_adapter_params(layers: int, local: int) -> int:
    """Bridge's LoRA on each expert's fc1 (A [r, h], B [2 moe_ffn, r]) and fc2 (A [r, moe_ffn], B [h, r])."""
    return layers * local * RANK * (H + 2 * MOE_FFN + MOE_FFN + H)


def _attention_adapter_params(layers: int, tp: int) -> int:
    """Bridge's LoRA on linear_qkv and linear_proj, split by TP (the MLP is the MoE layer, adapted per expert)."""
    qkv_out = (HEADS + 2 * GROUPS) * HEAD_DIM
    return layers * RANK * ((H + qkv_out) + (HEADS * HEAD_DIM + H)) // tp


def _part(est, name: str) -> int:
    return est.component(name).bytes


def test_lora_on_moe_expert_weights_are_frozen_and_expert_adapters_shard_over_expert_dp():
    """TP2 EP4 DP4 (ETP 1, Bridge's default with EP): 2 of 8 experts per rank; 8 GPUs per stage over a 1 x 4 expert
    grid give an expert DP of 2, where the dense DP is 4."""
    layers, tp, ep, dp = 3, 2, 4, 4
    est = memory.estimate(_tiny(tp=tp, ep=ep, dp=dp, layers=layers))
    local = EXPERTS_N // ep
    experts, expert_adapters = _expert_params(layers, local), _expert_adapter_params(layers, local)
    adapters = _attention_adapter_params(layers, tp)
    assert _part(est, "weights: experts") == experts * BF16
    assert "frozen" in est.component("weights: experts").basis
    assert _part(est, "weights: expert adapters") == expert_adapters * BF16
    assert _part(est, "weights: adapters") == adapters * BF16
    # bf16_mixed reduces gradients in fp32; only the adapters have them, the frozen experts none.
    assert _part(est, "gradients (main_grad buffer)") == (adapters + expert_adapters) * 4
    expert_dp = dp * tp // ep
    assert expert_dp == 2
    assert _part(est, "optimizer states") == -(-adapters * 12 // dp) + -(-expert_adapters * 12 // expert_dp)
    assert "expert DP = DP x TP x CP / (EP x ETP) = 2" in est.component("optimizer states").basis


def test_full_fine_tuning_divides_the_experts_optimizer_state_over_expert_dp():
    layers, tp, ep, dp = 3, 2, 4, 4
    est = memory.estimate(_tiny(tp=tp, ep=ep, dp=dp, layers=layers, peft="none"))
    experts = _expert_params(layers, EXPERTS_N // ep)
    total = sum(c.bytes for c in est.components if c.name.startswith("weights")) // BF16
    assert _part(est, "gradients (main_grad buffer)") == total * 4
    assert _part(est, "optimizer states") == -(-(total - experts) * 12 // dp) + -(-experts * 12 // (dp * tp // ep))


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_both_dispatchers_trace_and_hand_the_experts_the_balanced_tokens(dispatcher):
    """A balanced load: each of the rank's experts receives tokens x top-k / experts from each of the EP x ETP ranks
    that send to it, each holding its s/TP x b sequence shard; over experts / EP local experts that is
    s/TP x b x ETP x top-k (EP cancels). The saves are classified as experts and moe dispatch, not mlp."""
    est = memory.estimate(_tiny(dispatcher=dispatcher, peft="none"))
    tp, etp = 2, 1
    routed = (SEQ // tp) * 1 * etp * TOPK
    assert est.settings.moe.routed_tokens_per_layer == routed
    assert est.settings.moe.dispatcher == dispatcher
    saved = est.activations_per_microbatch
    assert saved[EXPERTS] > 0 and saved[MOE_DISPATCH] > 0 and saved[MLP] == 0
    glu_ffn = 2 * MOE_FFN
    assert _part(est, "layer backward") == routed * (glu_ffn + MOE_FFN + H) * BF16


def test_the_two_dispatchers_hand_the_experts_the_same_tokens():
    saved = {d: memory.estimate(_tiny(dispatcher=d, peft="none")).activations_per_microbatch[EXPERTS]
             for d in ("allgather", "alltoall")}
    assert saved["allgather"] == saved["alltoall"] > 0


def test_the_imbalance_scales_exactly_the_routed_part():
    """Twice the balanced load (16 -> 32 tokens per expert and source rank, whole numbers both) doubles what the
    experts save and the experts' backward transient; attention, norms and the loss do not change."""
    cfg = _tiny(peft="none")
    one, two = memory.estimate(cfg), memory.estimate(cfg, moe_imbalance=2.0)
    a, b = one.activations_per_microbatch, two.activations_per_microbatch
    assert b[EXPERTS] == 2 * a[EXPERTS]
    for category in (ATTENTION, NORMS, LOGITS_LOSS):
        assert b[category] == a[category]
    assert two.settings.moe.routed_tokens_per_layer == 2 * one.settings.moe.routed_tokens_per_layer
    assert _part(two, "layer backward") == 2 * _part(one, "layer backward")
    assert any("1.0, the default" in line for line in one.assumptions)
    assert any("2 x the balanced share" in line for line in two.assumptions)


@pytest.mark.parametrize("value, message", [
    (0.5, "moe_imbalance: 0.5 is not a load factor of 1 or more"),
    (float("nan"), "moe_imbalance: nan is not a load factor of 1 or more"),
    (5.0, f"moe_imbalance: 5 sends an expert more tokens than there are (at most experts / top-k = {EXPERTS_N} / "
          f"{TOPK} = 4 times the balanced share)"),
])
def test_a_load_factor_below_1_or_beyond_every_token_is_refused_in_one_line(value, message):
    with pytest.raises(Refused) as raised:
        memory.estimate(_tiny(peft="none"), moe_imbalance=value)
    assert raised.value.one_line().startswith(message), raised.value.one_line()
    assert ". Fix: " in raised.value.one_line()


def test_a_stage_traced_with_two_layers_is_the_stage_traced_whole(monkeypatch):
    """The shortcut (two layers traced, the second repeated) gives every component and category of the full trace."""
    cfg = _tiny(layers=4)
    short = memory.estimate(cfg)
    monkeypatch.setattr(memory, "traced_layers", lambda provider, stage=0: None)
    whole = memory.estimate(cfg)
    assert short.settings.layers_on_stage == whole.settings.layers_on_stage == 4
    assert [(c.name, c.bytes) for c in short.components] == [(c.name, c.bytes) for c in whole.components]
    assert short.activations_per_microbatch == whole.activations_per_microbatch
    assert short.activations_per_layer == whole.activations_per_layer


MIXED = [0, 1, 0, 1, 1]
"""Dense and MoE layers mixed (``moe_layer_freq``): the first layer dense, then MoE and dense in turn."""


def test_mixed_dense_and_moe_layers_hold_experts_and_a_dense_mlp_where_the_pattern_says():
    """Experts and expert adapters on the 3 MoE layers only; each dense layer's MLP (fc1 [2 ffn / TP, h], fc2
    [h, ffn / TP]) where the other two hold the router; a dense layer saves mlp, an MoE layer experts."""
    layers, tp, ep = len(MIXED), 2, 4
    est = memory.estimate(_tiny(tp=tp, ep=ep, layers=layers, extra=[f"model.moe_layer_freq={MIXED}"]))
    moe, dense = sum(MIXED), len(MIXED) - sum(MIXED)
    assert _part(est, "weights: experts") == _expert_params(moe, EXPERTS_N // ep) * BF16
    assert _part(est, "weights: expert adapters") == _expert_adapter_params(moe, EXPERTS_N // ep) * BF16
    assert est.settings.moe.layers_on_stage == moe and est.settings.layers_on_stage == layers
    dense_est = memory.estimate(_tiny(tp=tp, ep=ep, layers=layers, extra=["model.moe_layer_freq=[0, 0, 0, 0, 0]"]))
    # A dense layer's MLP: the whole model dense holds 5 of them, the mixed model 2, and the router per MoE layer.
    dense_mlp = (2 * FFN * H + FFN * H) // tp
    router = EXPERTS_N * H
    layer_weights = _part(dense_est, "weights: transformer layers") // BF16 - layers * dense_mlp
    assert _part(est, "weights: transformer layers") // BF16 == layer_weights + dense * dense_mlp + moe * router
    per_layer = est.activations_per_layer
    assert per_layer[1] == per_layer[3] == per_layer[4] != per_layer[2]


def test_a_mixed_stage_traced_with_one_layer_of_each_kind_is_the_stage_traced_whole(monkeypatch):
    """The shortcut for a pattern of dense and MoE layers (the first, then one of each kind, each later layer
    repeating the last traced one of its kind) gives every component and category of the full trace."""
    cfg = _tiny(layers=len(MIXED), extra=[f"model.moe_layer_freq={MIXED}"])
    assert memory.traced_layers(cfg.model) is not None
    short = memory.estimate(cfg)
    monkeypatch.setattr(memory, "traced_layers", lambda provider, stage=0: None)
    whole = memory.estimate(cfg)
    assert [(c.name, c.bytes) for c in short.components] == [(c.name, c.bytes) for c in whole.components]
    assert short.activations_per_microbatch == whole.activations_per_microbatch
    assert short.activations_per_layer == whole.activations_per_layer
    assert short.settings == whole.settings


def _recomputed_layer(est) -> int:
    """The bytes one layer saves when full recompute runs it again, as the transient's basis states them."""
    basis = est.component("recomputed layer in backward").basis
    return int(basis.split("measured: ")[1].split(" B")[0].replace(",", ""))


@pytest.mark.parametrize("pattern", [MIXED, [1, 0, 1, 1, 0]])
def test_full_recompute_of_mixed_layers_prices_the_larger_kind_of_layer(pattern):
    """Full recompute runs one layer again in backward: with dense and MoE layers mixed, the larger of the two, each
    as an all-dense and an all-MoE model of the same shape price it, whichever kind comes first."""
    full = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]

    def recomputed(freq):
        cfg = _tiny(layers=len(MIXED), extra=[*full, f"model.moe_layer_freq={freq}"])
        return _recomputed_layer(memory.estimate(cfg))

    dense, moe = recomputed([0] * len(MIXED)), recomputed([1] * len(MIXED))
    assert dense != moe
    assert recomputed(pattern) == max(dense, moe)


def test_the_reduced_stage_keeps_the_first_layer_and_one_of_each_kind_after_it():
    class Provider:
        num_moe_experts, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size = 8, 2, None
        num_layers_in_first_pipeline_stage = num_layers_in_last_pipeline_stage = recompute_granularity = None
        num_layers, moe_layer_freq = 10, [0, 0, 1, 0, 1, 1, 1, 1, 1, 1]

    first, second = memory.traced_layers(Provider(), 0), memory.traced_layers(Provider(), 1)
    assert (first.pattern, first.sources) == ([0, 0, 1], [0, 1, 2, 1, 2])
    assert (second.pattern, second.sources) == ([1, 1], [0, 1, 1, 1, 1])


def test_shared_experts_overlapped_with_the_dispatch_trace_without_cuda():
    """The overlap makes a CUDA side stream when the layer is built; without CUDA the estimate traces the overlapped
    path in program order. Its saves are not the in-order shared experts': the dispatcher does the shared experts'
    communication, and what it gathers for them counts as moe dispatch (the grid measures both to the byte)."""
    import torch

    shared = ["model.moe_shared_expert_intermediate_size=64"]
    streams = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream)
    overlapped = memory.estimate(_tiny(peft="none", extra=[*shared, "model.moe_shared_expert_overlap=True"]))
    in_order = memory.estimate(_tiny(peft="none", extra=shared))
    assert (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream) == streams
    assert overlapped.activations_per_microbatch[MLP] > 0
    assert overlapped.activations_per_microbatch[MOE_DISPATCH] != in_order.activations_per_microbatch[MOE_DISPATCH]


LOCAL_TOKENS = SEQ // 2  # s/TP x b tokens in each router (TP 2, SP, micro-batch 1)
SHARE = LOCAL_TOKENS * TOPK // EXPERTS_N  # the balanced tokens of one expert from one router: 16
SOURCES, LOCAL_EXPERTS = 4, EXPERTS_N // 4  # EP x ETP routers send to each expert; experts / EP on a rank


def _capacity(factor: float) -> int:
    """Core's get_capacity: ceil(tokens x top-k / experts x factor)."""
    return math.ceil(LOCAL_TOKENS * TOPK / EXPERTS_N * factor)


@pytest.fixture(scope="module")
def dropless():
    return {d: memory.estimate(_tiny(dispatcher=d, peft="none")) for d in ("allgather", "alltoall")}


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("factor, padded, per_expert", [
    (0.5, False, _capacity(0.5)),  # 8 < 16: capped
    (2.0, False, SHARE),  # 32 > 16: nothing dropped
    (0.5, True, _capacity(0.5)),
    (2.0, True, _capacity(2.0)),  # padded up to the capacity, 32
])
def test_token_dropping_caps_or_pads_each_experts_tokens_at_the_capacity(dropless, dispatcher, factor, padded,
                                                                         per_expert):
    """Each expert takes min(share, capacity) tokens from each router, exactly the capacity when padded; the experts'
    saves and their backward transient scale with those tokens, the rest of the layer does not."""
    extra = [f"model.moe_expert_capacity_factor={factor}", f"model.moe_pad_expert_input_to_capacity={padded}"]
    est, base = memory.estimate(_tiny(dispatcher=dispatcher, peft="none", extra=extra)), dropless[dispatcher]
    routed = per_expert * SOURCES * LOCAL_EXPERTS
    assert est.settings.moe.routed_tokens_per_layer == routed
    assert base.settings.moe.routed_tokens_per_layer == SHARE * SOURCES * LOCAL_EXPERTS
    a, b = base.activations_per_microbatch, est.activations_per_microbatch
    assert b[EXPERTS] * SHARE == a[EXPERTS] * per_expert
    for category in (ATTENTION, NORMS, LOGITS_LOSS):
        assert b[category] == a[category]
    assert _part(est, "layer backward") == routed * (2 * MOE_FFN + MOE_FFN + H) * BF16
    assert any("token dropping" in line for line in est.assumptions)


def test_token_dropping_on_deepep_is_not_modelled():
    with pytest.raises(memory.NotModelled) as raised:
        memory.estimate(_tiny(extra=["model.moe_expert_capacity_factor=1.0", "model.moe_token_dispatcher_type=flex",
                                     "model.moe_flex_dispatcher_backend=deepep"]))
    assert raised.value.findings[0].setting == "model.moe_expert_capacity_factor"


def test_expert_dp_is_a_stages_gpus_over_the_expert_grid():
    from megatron_bridge_ext.estimate.static import expert_data_parallel

    assert expert_data_parallel(data_parallel=4, tensor_parallel=2, context_parallel=1, expert_parallel=4,
                                expert_tensor_parallel=1) == 2
    assert expert_data_parallel(data_parallel=8, tensor_parallel=2, context_parallel=1, expert_parallel=8,
                                expert_tensor_parallel=1) == 2
    assert math.lcm(2, 8) == 8  # the fake world's ranks per stage for TP2/EP8: the expert grid's 8


def test_each_trace_has_its_own_moe_metrics_tracker():
    """The router records its auxiliary loss in Core's global MoE metrics tracker, sized by the layers of the first
    model that records: a one-stage trace (two layers) followed by a two-stage one (layers 1-4) once failed on it
    (index out of bounds); the caller's tracker is left as it was."""
    from megatron.core.transformer.moe import moe_logging

    mine = moe_logging.get_moe_metrics_tracker()
    memory.estimate(_tiny(layers=3, peft="none"))
    staged = configs.from_hf_config(QWEN3_30B_A3B, configs.Layout(tp=2, pp=2, ep=4, dp=4, seq=SEQ, peft="none"),
                                    ["model.num_layers=6", f"model.hidden_size={H}", f"model.ffn_hidden_size={FFN}",
                                     f"model.moe_ffn_hidden_size={MOE_FFN}", f"model.num_moe_experts={EXPERTS_N}",
                                     f"model.moe_router_topk={TOPK}", f"model.num_attention_heads={HEADS}",
                                     f"model.num_query_groups={GROUPS}", f"model.kv_channels={HEAD_DIM}",
                                     f"model.vocab_size={VOCAB}"])
    est = memory.estimate(staged)
    assert sorted(est.stage_peaks) == [0, 1] and est.settings.layers_on_stage == 3
    assert moe_logging.get_moe_metrics_tracker() is mine


def test_fp8_on_routed_experts_is_prepared_and_on_shared_experts_refused_by_name():
    """The routed experts' grouped linears follow TE's contract (estimate.features.fp8_experts; Core's TE >= 1.7.0
    check answered for the modelled release); shared experts' TE linears do not, so they are named as not modelled."""
    cfg = _tiny(extra=["mixed_precision=bf16_with_fp8_current_scaling_mixed"])
    assert memory.prepare(cfg, data_parallel_size=4, num_microbatches=1).provider.fp8
    shared = _tiny(extra=["mixed_precision=bf16_with_fp8_current_scaling_mixed",
                          "model.moe_shared_expert_intermediate_size=64"])
    with pytest.raises(memory.NotModelled) as raised:
        memory.prepare(shared, data_parallel_size=4, num_microbatches=1)
    assert [f.setting for f in raised.value.findings] == ["model.fp8"]
    assert "shared experts" in raised.value.findings[0].message
