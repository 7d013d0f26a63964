"""The roofline step time: every expected figure derived here by hand from the shapes and the datasheet rates."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate.mamba import MambaShapes
from megatron_bridge_ext.estimate.settings import HybridSettings, Settings
from megatron_bridge_ext.levers import steptime
from tests.support import settings as support

pytestmark = [pytest.mark.unit]

# NVIDIA's datasheets quote tensor-core rates with sparsity (dense: half) and NVLink as both directions together.
H100_BF16_SPARSE, H100_FP8_SPARSE, H100_NVLINK_BOTH = 1979e12, 3958e12, 900e9
H100_HBM, IB_PORT_BITS, PCIE5_BOTH = 3.35e12, 400e9, 128e9
B200_BF16_SPARSE, B200_NVLINK_BOTH = 4.5e15, 1.8e12

T, H, FFN, V, L, M = 1024, 1024, 4096, 32000, 2, 4  # tokens per microbatch, hidden, ffn, vocab, layers, microbatches


def settings(**changes) -> Settings:
    """A GPT stage as the estimate's settings: 8 heads of 128 (MHA), GeLU MLP, bf16, full fine-tuning, TP 2 + SP."""
    s = dict(tp=2, pp=1, vpp=None, cp=1, dp=1, sequence_parallel=True, seq_length=T, micro_batch=1, num_microbatches=M,
             dtype="bfloat16", stage=0, layers_on_stage=L, hidden=H, ffn=FFN, heads=8, query_groups=8, kv_channels=128,
             num_layers=L, gated_linear_unit=False, vocab_size=V, recompute_granularity=None, recompute_modules=(),
             distributed_optimizer=True, peft=None)
    return support.gpt_stage(**{**s, **changes})


def forward_flops(tp: int) -> tuple[int, int, int]:
    """Per microbatch and TP rank: one layer's linears (QKV h->3h, proj h->h, fc1 h->4h, fc2 4h->h), its attention
    core (QK^T and AV, s x s x h each) and the output layer (h->V), 2 FLOPs per multiply-add."""
    linears = 2 * T * (H * 3 * H + H * H + H * FFN + FFN * H) // tp
    core = 2 * 2 * T * T * H // tp
    output = 2 * T * H * V // tp
    return linears, core, output


H100 = steptime.gpu("h100")
PEAK, NVLINK = H100_BF16_SPARSE / 2, H100_NVLINK_BOTH / 2


def test_presets_are_the_datasheets_dense_rates_per_direction():
    assert (H100.bf16_flops, H100.fp8_flops) == (H100_BF16_SPARSE / 2, H100_FP8_SPARSE / 2)
    assert (H100.hbm, H100.nvlink, H100.ib, H100.pcie) == (H100_HBM, H100_NVLINK_BOTH / 2, IB_PORT_BITS / 8,
                                                          PCIE5_BOTH / 2)
    h200, b200 = steptime.gpu("h200"), steptime.gpu("b200")
    assert h200.bf16_flops == H100.bf16_flops and h200.hbm == 4.8e12  # the same tensor cores, HBM3e
    assert (b200.bf16_flops, b200.nvlink) == (B200_BF16_SPARSE / 2, B200_NVLINK_BOTH / 2)
    assert all("datasheet" in g.source for g in steptime.GPUS.values())


def test_overrides_replace_the_preset_and_fp8_follows_the_bf16_rate():
    g = steptime.gpu("h100", bf16_flops=500e12, ib=25e9)
    assert (g.bf16_flops, g.fp8_flops, g.ib, g.nvlink) == (500e12, 1000e12, 25e9, H100.nvlink)
    assert "overridden: bf16_flops, ib" in g.source
    with pytest.raises(steptime.UnknownGpu, match="'a100' is not a GPU preset"):
        steptime.gpu("a100")


def test_a_preset_is_named_in_any_case():
    """--gpu H100, as NVIDIA's datasheets write it, is the h100 preset."""
    assert steptime.gpu("H100") is steptime.GPUS["h100"] and steptime.gpu("B200") is steptime.GPUS["b200"]


def test_a_group_beyond_a_node_of_8_uses_infiniband():
    assert (H100.link(8), H100.link(16)) == (H100.nvlink, H100.ib)


def test_full_fine_tuning_step_time_by_hand():
    """6x forward FLOPs for trainable linears (3 passes x 2 FLOPs), 3 passes of the attention core, TP's
    2 all-gathers + 2 reduce-scatters of [s, b, h] forward and backward sending (t-1)/t each, on NVLink."""
    linears, core, output = forward_flops(2)
    flops = L * (3 * linears + 3 * core) + 3 * output
    tp_sent = 8 * T * H * 2 * L // 2  # 8 collectives x [s, b, h] bf16 x (2-1)/2, per layer
    t = steptime.step_time(settings(), H100)
    assert t.compute == pytest.approx(M * flops / PEAK, rel=1e-12)
    assert t.tp == pytest.approx(M * tp_sent / NVLINK, rel=1e-12)
    assert (t.dispatch, t.pp_p2p, t.bubble, t.dp_exposed, t.offload_exposed) == (0, 0, 0, 0, 0)


def test_lora_frozen_linears_take_4x_not_6x_and_the_adapters_input_collectives_count():
    """Under LoRA the base linears and the output layer have no weight gradient (forward + input gradient:
    2 x forward, 4 FLOPs per multiply-add and token, not 6); LoRA-A's Bridge path on linear_qkv and linear_fc1
    gathers x (s*b*h) and the rank-r output (s*b*r) forward, reduce-scatters x's grad (s*b*h) backward, except the first linear_qkv."""
    r = 16
    s = settings(peft=support.lora(r, ["linear_qkv", "linear_fc1"], strategy="off"))
    linears, core, output = forward_flops(2)
    flops = L * (2 * linears + 3 * core) + 2 * output
    adapters = 2 * L
    lora_elements = adapters * (2 * T * H + T * r) - T * H  # the first layer's linear_qkv: no input gradient
    tp_sent = 8 * T * H * 2 * L // 2 + lora_elements * 2 // 2
    t = steptime.step_time(s, H100)
    assert t.compute == pytest.approx(M * flops / PEAK, rel=1e-12)
    assert t.tp == pytest.approx(M * tp_sent / NVLINK, rel=1e-12)


def test_regather_adds_one_gather_of_x_per_adapter_and_shard_local_drops_both():
    r = 16
    t = {k: steptime.step_time(settings(peft=support.lora(r, ["linear_qkv", "linear_fc1"], strategy=k)), H100) for k in
         ("off", "regather", "shard_local")}
    adapters, x = 2 * L, T * H * 2 // 2  # bytes one [s, b, h] collective sends from a rank at TP 2
    assert t["regather"].tp - t["off"].tp == pytest.approx(M * adapters * x / NVLINK, rel=1e-9)
    # shard_local: s*b*r + 3*r*h per adapter (2*r*h on the first linear_qkv) in place of s*b*r + 2*s*b*h
    saved = adapters * 2 * T * H - T * H - (adapters * 3 - 1) * r * H
    assert t["off"].tp - t["shard_local"].tp == pytest.approx(M * saved * 2 // 2 / NVLINK, rel=1e-9)


def test_mlp_recompute_costs_its_forward_flops_at_peak():
    before, after = steptime.step_time(settings(), H100), steptime.step_time(
        settings(recompute_granularity="selective", recompute_modules=("mlp",)), H100)
    mlp = 2 * T * (H * FFN + FFN * H) // 2
    assert after.total - before.total == pytest.approx(M * L * mlp / PEAK, rel=1e-9)
    assert steptime.change_pct(before, after) == pytest.approx(100 * M * L * mlp / PEAK / before.total, rel=1e-9)


def test_layernorm_recompute_reads_and_writes_two_norms_at_hbm_bandwidth():
    before, after = steptime.step_time(settings(), H100), steptime.step_time(
        settings(recompute_granularity="selective", recompute_modules=("layernorm",)), H100)
    per_layer = 2 * 2 * (T // 2) * H * 2  # 2 norms, read + write, [s/t, b, h] bf16
    assert after.total - before.total == pytest.approx(M * L * per_layer / H100_HBM, rel=1e-9)


@pytest.mark.parametrize("pp, vpp", [(2, None), (4, None), (4, 2)])
def test_the_bubble_is_pp_minus_1_over_vpp_m_of_the_ideal(pp, vpp):
    t = steptime.step_time(settings(pp=pp, vpp=vpp), H100)
    assert t.bubble / (t.compute + t.tp) == pytest.approx((pp - 1) / ((vpp or 1) * M), rel=1e-12)


def test_tp_x2_at_fixed_gpus_keeps_compute_and_pays_tp_traffic_and_dp():
    """TP 2 -> 4, DP 2 -> 1: half the FLOPs per microbatch, twice the microbatches; TP sends 3/4 instead of 1/2
    of [s, b, h] per collective, on twice the microbatches; DP's traffic (overlapped) goes away."""
    before = steptime.step_time(settings(dp=2), H100)
    after = steptime.step_time(settings(tp=4, dp=1, num_microbatches=2 * M), H100)
    assert after.compute == pytest.approx(before.compute, rel=1e-12)
    layer_tp = 8 * T * H * 2 * L
    assert before.tp == pytest.approx(M * layer_tp / 2 / NVLINK, rel=1e-12)
    assert after.tp == pytest.approx(2 * M * layer_tp * 3 / 4 / NVLINK, rel=1e-12)
    params = (L * (H * 3 * H + H * H + 2 * H * FFN) + 2 * V * H) // 2  # both ends on the one stage, over TP 2
    dp_time = (4 + 2) * params / 2 / NVLINK  # fp32 grads reduce-scattered, bf16 params gathered, (2-1)/2 sent
    assert before.dp_exposed == max(0.0, dp_time - before.compute) and after.dp_exposed == 0
    assert steptime.change_pct(before, after) == pytest.approx(
        100 * (after.tp - before.tp - before.dp_exposed) / before.total, rel=1e-9)


def test_pp_x2_at_fixed_gpus_pays_the_bubble_and_p2p():
    """PP 1 -> 2, DP 2 -> 1 (the 2 layers split, the output layer stays on the last stage): each microbatch's
    p2p sends [s/t, b, h] forward and back; the bubble is one microbatch's time in 2M."""
    before = steptime.step_time(settings(dp=2), H100)
    after = steptime.step_time(settings(pp=2, dp=1, layers_on_stage=1, num_microbatches=2 * M), H100)
    linears, core, output = forward_flops(2)
    compute_mb = (3 * linears + 3 * core + 3 * output) / PEAK
    tp_mb = 8 * T * H * 2 * 1 / 2 / NVLINK
    assert after.compute == pytest.approx(2 * M * compute_mb, rel=1e-12)
    assert after.pp_p2p == pytest.approx(2 * M * 2 * (T // 2) * H * 2 / NVLINK, rel=1e-12)  # 4 ranks: one node
    assert after.bubble == pytest.approx(compute_mb + tp_mb, rel=1e-12)


def test_pipeline_p2p_leaves_the_node_when_the_replica_does():
    t = steptime.step_time(settings(pp=2, dp=4, layers_on_stage=1), H100)  # 2 x 4 x 2 = 16 ranks
    assert t.pp_p2p == pytest.approx(M * 2 * (T // 2) * H * 2 / H100.ib, rel=1e-12)


def test_offloading_pays_what_the_compute_does_not_hide_and_at_least_one_layer():
    base = steptime.step_time(settings(), H100)
    small, large = 1_000_000, 10**12
    assert steptime.step_time(settings(), H100, offload_bytes=small).offload_exposed == pytest.approx(
        small / H100.pcie / L)
    assert steptime.step_time(settings(), H100, offload_bytes=large).offload_exposed == pytest.approx(
        large / H100.pcie - base.compute)


def test_fp8_uses_the_fp8_peak():
    t8, t16 = steptime.step_time(settings(fp8="hybrid"), H100), steptime.step_time(settings(), H100)
    assert t8.compute == pytest.approx(t16.compute * H100_BF16_SPARSE / H100_FP8_SPARSE, rel=1e-12)


def moe_shape(ep: int) -> dict:
    """8 experts of width 512 (GeLU), top-2, the all-to-all dispatcher, every layer MoE, no shared expert."""
    return {"experts": 8, "topk": 2, "moe_ffn": 512, "shared_ffn": 0, "ep": ep, "etp": 1, "dispatcher": "alltoall",
            "grouped_gemm": False, "pattern": [1] * L}


def test_moe_layers_price_the_router_the_routed_experts_and_the_dispatch():
    """Per MoE layer and microbatch, the rank's T = s/t tokens (SP) go through the router (T x h x E) and, balanced,
    T*k token copies through fc1 and fc2 of width 512 whatever EP; the all-to-all sends T*k*h (EP-1)/EP four times
    (dispatch and combine, forward and backward) on NVLink; TP keeps attention's half (2 all-gathers + 2
    reduce-scatters). Raising EP 2 -> 4 changes only the dispatch share, 1/2 -> 3/4 (the expert DP traffic is
    overlapped with compute)."""
    s = settings(dp=2, moe=support.experts(L, experts=8, topk=2, ffn=512, ep=2))
    tokens, k = T // 2, 2
    _, core, output = forward_flops(2)
    attention = 2 * T * (H * 3 * H + H * H) // 2
    experts = 2 * tokens * H * 8 + 2 * tokens * k * H * 512 * 2
    before, after = steptime.step_time(s, H100, moe=moe_shape(2)), steptime.step_time(s, H100, moe=moe_shape(4))
    assert before.compute == pytest.approx(M * (L * (3 * (attention + experts) + 3 * core) + 3 * output) / PEAK,
                                           rel=1e-12)
    tp = 4 * T * H * 2 * L // 2
    dispatch = 4 * tokens * k * H * 2 * L
    assert before.tp == pytest.approx(M * tp / NVLINK, rel=1e-12) and after.tp == before.tp
    assert before.dispatch == pytest.approx(M * dispatch / 2 / NVLINK, rel=1e-12)
    assert after.dispatch == pytest.approx(M * dispatch * 3 / 4 / NVLINK, rel=1e-12)
    assert (before.dp_exposed, after.dp_exposed) == (0, 0) and after.compute == before.compute


HYBRID = {"Mamba": 2, "attention": 1, "MLP": 1}
"""A hybrid stage M*M- (Bridge's hybrid_layer_pattern): each layer holds one kind."""
MAMBA = MambaShapes(heads=16, head_dim=64, groups=4, state=32, chunk=128)
"""The whole mixer: d_inner 16 x 64 = 1024, in_proj h -> 2 x 1024 + 2 x 4 x 32 + 16."""
MAMBA_IN_PROJ, MAMBA_INNER = 2 * 1024 + 2 * 4 * 32 + 16, 1024


def hybrid_settings(**changes) -> Settings:
    return settings(layers_on_stage=4, num_layers=4, hybrid=HybridSettings(HYBRID, MAMBA), **changes)


def test_a_hybrid_stage_counts_each_layer_by_its_kind():
    """On TP 2: the two Mamba layers' projections (in_proj, out_proj) and scans (per token and TP rank: C B^T over a
    128-token chunk per group, the masked product with x and the state products per head), the attention layer's
    linears and core, the MLP layer's fc1 and fc2; TP sends one all-gather + reduce-scatter pair of [s, b, h] forward
    and backward per layer (4 collectives, not a GPT layer's 8)."""
    tp, heads, groups = 2, 8, 2
    mamba_linears = 2 * T * (H * MAMBA_IN_PROJ + MAMBA_INNER * H) // tp
    scan = T * (2 * 128 * 32 * groups + 2 * 128 * 64 * heads + 4 * 32 * 64 * heads)
    attention, mlp = 2 * T * (H * 3 * H + H * H) // tp, 2 * T * (H * FFN + FFN * H) // tp
    core, output = 2 * 2 * T * T * H // tp, 2 * T * H * V // tp
    flops = 3 * (2 * mamba_linears + attention + mlp) + 3 * (core + 2 * scan) + 3 * output
    tp_sent = 4 * T * H * 2 * 4 // 2  # 4 collectives x [s, b, h] bf16 x 4 layers x (2-1)/2
    t = steptime.step_time(hybrid_settings(), H100)
    assert t.compute == pytest.approx(M * flops / PEAK, rel=1e-12)
    assert t.tp == pytest.approx(M * tp_sent / NVLINK, rel=1e-12)


def test_a_hybrid_stage_trains_the_linears_of_its_layers_kinds():
    """Full fine-tuning on DP 2 with the distributed optimizer: each rank reduce-scatters fp32 gradients (4 B) and
    gathers bf16 parameters (2 B) of half of its trainable parameters: attention's, the MLP's, two Mamba layers'
    projections, the embedding and the output layer, over TP 2. Under LoRA on linear_qkv and in_proj: r x (in + out)
    on the one attention layer and the two Mamba layers."""
    full = (H * 3 * H + H * H + 2 * H * FFN + 2 * (H * MAMBA_IN_PROJ + MAMBA_INNER * H) + 2 * V * H) // 2
    assert steptime.dp_bytes(hybrid_settings(dp=2)) == (4 + 2) * full // 2
    lora = 8 * ((H + 3 * H) + 2 * (H + MAMBA_IN_PROJ)) // 2
    s = hybrid_settings(dp=2, peft=support.lora(8, ["linear_qkv", "in_proj"]))
    assert steptime.dp_bytes(s) == (4 + 2) * lora // 2


def test_layernorm_recompute_reads_one_norm_per_non_mamba_layer_of_a_hybrid_stage():
    """Core's MambaLayer recomputes nothing; the attention and MLP layers have one norm each: 2 norms x [s/2, b, h]
    read and written, where a GPT stage of 4 layers has 8."""
    s = hybrid_settings(recompute_granularity="selective", recompute_modules=("layernorm",))
    assert steptime.recompute_hbm_bytes(s) == 2 * (T // 2) * H * 2 * 2
    gpt = settings(layers_on_stage=4, recompute_granularity="selective", recompute_modules=("layernorm",))
    assert steptime.recompute_hbm_bytes(gpt) == 2 * (T // 2) * H * 2 * 8


# Multi-latent attention: q_lora_rank 256, kv_lora_rank 128, per head qk 64 + rope 32 and v 64, 8 heads.
Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 256, 128, 64, 32, 64


def latent_settings(**changes) -> Settings:
    return settings(**{"mla": support.latent(Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD),
                       "transformer_impl": "transformer_engine", **changes})


@pytest.mark.parametrize("sequence_parallel, impl, split", [
    (True, "transformer_engine", 2), (False, "transformer_engine", 1), (False, "local", 2)])
def test_latent_attention_linears_by_hand(sequence_parallel, impl, split):
    """On TP 2: the down projections whole on a rank's own tokens in Transformer Engine's layout (its sequence shard
    under SP, every token without: not split), column-parallel on the gathered sequence on the local spec; the up
    projections and the output projection split over TP; 2 FLOPs per multiply-add."""
    down = 2 * T * H * (Q_LORA + KV_LORA + ROPE) // split
    up = 2 * T * (Q_LORA * 8 * (NOPE + ROPE) + KV_LORA * 8 * (NOPE + V_HEAD)) // 2
    proj = 2 * T * 8 * V_HEAD * H // 2
    s = latent_settings(sequence_parallel=sequence_parallel, transformer_impl=impl)
    assert steptime.attention_linear_flops(s) == down + up + proj


def test_latent_attention_trains_its_down_projections_whole_on_every_rank():
    """Full fine-tuning on DP 2 with the distributed optimizer, TP 2: the down projections' parameters whole on each
    rank in Transformer Engine's layout, every other linear (the up and output projections, the MLP, the embedding and
    the output layer) split over TP."""
    split = (Q_LORA * 8 * (NOPE + ROPE) + KV_LORA * 8 * (NOPE + V_HEAD) + 8 * V_HEAD * H + 2 * H * FFN) * L
    whole = H * (Q_LORA + KV_LORA + ROPE) * L
    trainable = (split + 2 * V * H) // 2 + whole
    assert steptime.dp_bytes(latent_settings(dp=2)) == (4 + 2) * trainable // 2
