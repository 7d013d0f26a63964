"""The step time: every expected figure derived here by hand from the shapes, the datasheet rates and the calibration's
efficiency formula (a GEMM of f FLOPs at fraction x f / (f + half) of its precision's peak)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate.mamba import MambaShapes
from megatron_bridge_ext.estimate.settings import HybridSettings, Settings
from megatron_bridge_ext.levers import calibration, steptime
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
ATTENTION, MLP = 2 * T * (H * 3 * H + H * H), 2 * T * (H * FFN + FFN * H)
"""One layer's attention linears (QKV, projection) and MLP (fc1, fc2) forward FLOPs per microbatch, before TP."""


def gemm_seconds(flops: float, gemms: int = 1, fp8: bool = False) -> float:
    """``flops`` in ``gemms`` equal GEMMs at the calibration's efficiency of their size on the H100 peak."""
    f = flops / gemms
    fraction = calibration.GEMM_PEAK_FRACTION_FP8 if fp8 else calibration.GEMM_PEAK_FRACTION_BF16
    return flops / ((PEAK * 2 if fp8 else PEAK) * fraction * f / (f + calibration.GEMM_HALF_FLOPS))


def core_seconds(flops: float) -> float:
    """The causal attention core: half the s x s FLOPs at the large-GEMM fraction of the BF16 peak."""
    return flops / 2 / (PEAK * calibration.GEMM_PEAK_FRACTION_BF16)


def layer_seconds(tp: int, passes: int = 3, fp8: bool = False) -> float:
    """One GPT layer's linears (``passes`` x forward) and core (3 x forward) per microbatch on a TP rank."""
    linears = passes * (gemm_seconds(ATTENTION // tp, 2, fp8) + gemm_seconds(MLP // tp, 2, fp8))
    return linears + 3 * core_seconds(2 * 2 * T * T * H // tp)


def output_seconds(tp: int, passes: int = 3) -> float:
    return passes * gemm_seconds(2 * T * H * V // tp)


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
    tp_sent = 8 * T * H * 2 * L // 2  # 8 collectives x [s, b, h] bf16 x (2-1)/2, per layer
    t = steptime.step_time(settings(sequence_parallel=False), H100)
    assert t.compute == pytest.approx(M * (L * layer_seconds(2) + output_seconds(2)), rel=1e-12)
    assert t.tp == pytest.approx(M * tp_sent / NVLINK, rel=1e-12)  # no SP: no tp_comm_overlap
    assert (t.dispatch, t.pp_p2p, t.bubble, t.dp_exposed, t.offload_exposed, t.cp) == (0, 0, 0, 0, 0, 0)


def test_tp_comm_overlap_under_sp_hides_the_collectives_up_to_the_linears_time():
    """Bridge's tp_comm_overlap (kept only with SP) runs the collectives under the linears: exposed only beyond their
    time; without it, or without SP, all of them."""
    linears = 3 * L * (gemm_seconds(ATTENTION // 2, 2) + gemm_seconds(MLP // 2, 2))
    slow = steptime.gpu("h100", nvlink=1e9)
    tp_sent = 8 * T * H * 2 * L // 2
    overlapped = settings(tp_comm_overlap=True)
    assert steptime.step_time(overlapped, H100).tp == pytest.approx(M * max(0.0, tp_sent / NVLINK - linears), abs=1e-15)
    assert steptime.step_time(overlapped, slow).tp == pytest.approx(M * (tp_sent / 1e9 - linears), rel=1e-12)
    for plain in (settings(), settings(tp_comm_overlap=True, sequence_parallel=False)):
        assert steptime.step_time(plain, slow).tp == pytest.approx(M * tp_sent / 1e9, rel=1e-12)


def test_lora_frozen_linears_take_4x_not_6x_and_the_adapters_input_collectives_count():
    """Under LoRA the base linears and the output layer have no weight gradient (forward + input gradient:
    2 x forward, 4 FLOPs per multiply-add and token, not 6); LoRA-A's Bridge path on linear_qkv and linear_fc1
    gathers x (s*b*h) and the rank-r output (s*b*r) forward, reduce-scatters x's grad (s*b*h) backward, except the first linear_qkv."""
    r = 16
    s = settings(peft=support.lora(r, ["linear_qkv", "linear_fc1"], strategy="off"))
    adapters = 2 * L
    lora_elements = adapters * (2 * T * H + T * r) - T * H  # the first layer's linear_qkv: no input gradient
    tp_sent = 8 * T * H * 2 * L // 2 + lora_elements * 2 // 2
    t = steptime.step_time(s, H100)
    assert t.compute == pytest.approx(M * (L * layer_seconds(2, passes=2) + output_seconds(2, passes=2)), rel=1e-12)
    assert steptime.tp_bytes(s) == tp_sent


def test_regather_adds_one_gather_of_x_per_adapter_and_shard_local_drops_both():
    r = 16
    t = {k: steptime.tp_bytes(settings(peft=support.lora(r, ["linear_qkv", "linear_fc1"], strategy=k))) for k in
         ("off", "regather", "shard_local")}
    adapters, x = 2 * L, T * H * 2 // 2  # bytes one [s, b, h] collective sends from a rank at TP 2
    assert t["regather"] - t["off"] == adapters * x
    # shard_local: s*b*r + 3*r*h per adapter (2*r*h on the first linear_qkv) in place of s*b*r + 2*s*b*h
    saved = adapters * 2 * T * H - T * H - (adapters * 3 - 1) * r * H
    assert t["off"] - t["shard_local"] == saved * 2 // 2


def test_mlp_recompute_costs_its_forward_at_the_mlps_gemm_efficiency():
    before, after = steptime.step_time(settings(), H100), steptime.step_time(
        settings(recompute_granularity="selective", recompute_modules=("mlp",)), H100)
    mlp = gemm_seconds(MLP // 2, 2)
    assert after.total - before.total == pytest.approx(M * L * mlp, rel=1e-9)
    assert steptime.change_pct(before, after) == pytest.approx(100 * M * L * mlp / before.total, rel=1e-9)


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
    before = steptime.step_time(settings(dp=2, sequence_parallel=False), H100)
    after = steptime.step_time(settings(tp=4, dp=1, num_microbatches=2 * M, sequence_parallel=False), H100)
    assert before.compute == pytest.approx(M * (L * layer_seconds(2) + output_seconds(2)), rel=1e-12)
    assert after.compute == pytest.approx(2 * M * (L * layer_seconds(4) + output_seconds(4)), rel=1e-12)
    assert after.compute > before.compute  # the same FLOPs in GEMMs of half the size: less efficient
    layer_tp = 8 * T * H * 2 * L
    assert before.tp == pytest.approx(M * layer_tp / 2 / NVLINK, rel=1e-12)
    assert after.tp == pytest.approx(2 * M * layer_tp * 3 / 4 / NVLINK, rel=1e-12)
    params = (L * (H * 3 * H + H * H + 2 * H * FFN) + 2 * V * H) // 2  # both ends on the one stage, over TP 2
    dp_time = (4 + 2) * params / 2 / NVLINK  # fp32 grads reduce-scattered, bf16 params gathered, (2-1)/2 sent
    assert before.dp_exposed == max(0.0, dp_time - before.compute) and after.dp_exposed == 0
    assert after.optimizer == pytest.approx(before.optimizer, rel=1e-12)  # a quarter of the parameters either way


def test_pp_x2_at_fixed_gpus_pays_the_bubble_and_p2p():
    """PP 1 -> 2, DP 2 -> 1 (the 2 layers split, the output layer stays on the last stage): each microbatch's
    p2p sends [s/t, b, h] forward and back; the bubble is one microbatch's time in 2M."""
    after = steptime.step_time(settings(pp=2, dp=1, layers_on_stage=1, num_microbatches=2 * M,
                                       sequence_parallel=False), H100)
    compute_mb = layer_seconds(2) + output_seconds(2)
    tp_mb = 8 * T * H * 2 * 1 / 2 / NVLINK
    assert after.compute == pytest.approx(2 * M * compute_mb, rel=1e-12)
    assert after.pp_p2p == pytest.approx(2 * M * 2 * T * H * 2 / NVLINK, rel=1e-12)  # 4 ranks: one node; no SP
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


def test_fp8_runs_the_linears_at_the_fp8_peak_and_keeps_the_core_and_output_layer_in_bf16():
    t8 = steptime.step_time(settings(fp8="hybrid"), H100)
    assert t8.compute == pytest.approx(M * (L * layer_seconds(2, fp8=True) + output_seconds(2)), rel=1e-12)


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
    _, core, _ = forward_flops(2)
    attention = 2 * T * (H * 3 * H + H * H) // 2
    experts = 2 * tokens * H * 8 + 2 * tokens * k * H * 512 * 2
    before, after = steptime.step_time(s, H100, moe=moe_shape(2)), steptime.step_time(s, H100, moe=moe_shape(4))
    layer = 3 * (gemm_seconds(attention, 2) + gemm_seconds(experts, 2 * 8 // 2)) + 3 * core_seconds(core)
    assert before.compute == pytest.approx(M * (L * layer + output_seconds(2)), rel=1e-12)
    tp = 4 * T * H * 2 * L // 2
    dispatch = 4 * tokens * k * H * 2 * L
    assert before.tp == pytest.approx(M * tp / NVLINK, rel=1e-12) and after.tp == before.tp
    assert before.dispatch == pytest.approx(M * dispatch / 2 / NVLINK, rel=1e-12)
    assert after.dispatch == pytest.approx(M * dispatch * 3 / 4 / NVLINK, rel=1e-12)
    assert (before.dp_exposed, after.dp_exposed) == (0, 0)
    assert after.compute < before.compute  # 2 local experts at EP 4, twice the tokens each: larger GEMMs


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
    seconds = (3 * (2 * gemm_seconds(mamba_linears, 2) + gemm_seconds(attention, 2) + gemm_seconds(mlp, 2))
               + 3 * core_seconds(core) + 3 * 2 * scan / (PEAK * calibration.GEMM_PEAK_FRACTION_BF16)
               + 3 * gemm_seconds(output))
    tp_sent = 4 * T * H * 2 * 4 // 2  # 4 collectives x [s, b, h] bf16 x 4 layers x (2-1)/2
    t = steptime.step_time(hybrid_settings(sequence_parallel=False), H100)
    assert t.compute == pytest.approx(M * seconds, rel=1e-12)
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


GB200_BF16_SPARSE_RACK, GB200_FP8_SPARSE_RACK = 360e15, 720e15  # GB200/GB300 NVL72 datasheets, 72 GPUs
B300_BF16_SPARSE_NODE, B300_FP8_SPARSE_NODE = 36e15, 72e15  # HGX B300 datasheet, 8 GPUs


def test_blackwell_presets_are_their_datasheets_dense_rates_and_nvl72_spans_the_rack():
    gb200, gb300, b300 = steptime.gpu("gb200"), steptime.gpu("gb300"), steptime.gpu("b300")
    for g in (gb200, gb300):
        assert (g.bf16_flops, g.fp8_flops) == (GB200_BF16_SPARSE_RACK / 72 / 2, GB200_FP8_SPARSE_RACK / 72 / 2)
        assert (g.link(72), g.link(73)) == (g.nvlink, g.ib)
    assert (b300.bf16_flops, b300.fp8_flops) == (B300_BF16_SPARSE_NODE / 8 / 2, B300_FP8_SPARSE_NODE / 8 / 2)
    assert (b300.link(8), b300.link(16)) == (b300.nvlink, b300.ib)


def test_dp_traffic_is_hidden_by_the_compute_and_only_its_excess_is_exposed():
    """overlap_grad_reduce and overlap_param_gather (Bridge turns them on with DP > 1): on a slow enough link the
    step pays the DP time beyond the compute, on NVLink nothing."""
    params = (L * (H * 3 * H + H * H + 2 * H * FFN) + 2 * V * H) // 2
    slow = steptime.gpu("h100", nvlink=1e8)
    fast_t, slow_t = steptime.step_time(settings(dp=2), H100), steptime.step_time(settings(dp=2), slow)
    dp_time = (4 + 2) * params / 2 / 1e8
    assert fast_t.dp_exposed == 0 and (4 + 2) * params / 2 / NVLINK < fast_t.compute
    assert slow_t.dp_exposed == pytest.approx(dp_time - slow_t.compute, rel=1e-12) and slow_t.dp_exposed > 0


def test_pipeline_p2p_is_hidden_with_virtual_stages():
    """overlap_p2p_comm: Bridge turns it on only with VPP > 1 (comm_overlap.py L453-457)."""
    assert steptime.step_time(settings(pp=2, vpp=2, layers_on_stage=1), H100).pp_p2p == 0
    assert steptime.step_time(settings(pp=2, layers_on_stage=1), H100).pp_p2p > 0


def test_cp_ring_exchange_runs_under_the_attention_core():
    """CP 2: each layer sends its K and V chunk (s/2 tokens, kv heads over TP) one hop forward, three times in all
    with the backward; hidden while the core's time covers it, else its excess on every microbatch."""
    kv = 2 * 8 * 128 // 2  # K and V of 8 heads x 128 over TP 2
    sent = 3 * (T // 2) * kv * 2 * L
    assert steptime.cp_bytes(settings(cp=2)) == sent
    core = 3 * L * core_seconds(2 * 2 * T * T * H // 2) / 2  # the rank's half of the sequence
    slow = steptime.gpu("h100", nvlink=1e7)
    assert steptime.step_time(settings(cp=2), steptime.gpu("h100", nvlink=1e15)).cp == 0
    assert steptime.step_time(settings(cp=2), slow).cp == pytest.approx(M * (sent / 1e7 - core), rel=1e-12)


def test_the_optimizer_step_moves_its_shards_bytes_at_hbm_bandwidth():
    """Adam on the rank's shard of the trainable parameters (DP 2, distributed optimizer): 30 bytes per parameter."""
    params = (L * (H * 3 * H + H * H + 2 * H * FFN) + 2 * V * H) // 2 / 2
    assert steptime.step_time(settings(dp=2), H100).optimizer == pytest.approx(30 * params / H100_HBM, rel=1e-12)


@pytest.mark.parametrize("strategy, per_microbatch, per_step", [
    ("optim_grads_params", 3, 0), ("optim_grads", 1, 1), ("optim", 0, 2), ("no_shard", 0, 2)])
def test_fsdp_sends_each_microbatchs_gathers_and_reduce_scatters_in_bf16(strategy, per_microbatch, per_step):
    """Sharded gradients: a bf16 reduce-scatter every microbatch; sharded parameters: a bf16 all-gather for each
    layer's forward and again for its backward; otherwise one exchange of 2 x 2 B per parameter in the step."""
    s = settings(dp=4, num_microbatches=6, fsdp=strategy)
    params = steptime.trainable_params(s)
    expected = (per_microbatch * s.num_microbatches + per_step) * 2 * params * (s.dp - 1) // s.dp
    assert steptime.dp_bytes(s) == expected


def test_bf16_moments_save_their_read_and_write_in_the_optimizer_step():
    fp32, bf16 = settings(moment_bytes=8), settings(moment_bytes=4)
    saved = 2 * (8 - 4) * steptime.trainable_params(fp32) / steptime.gpu().hbm
    assert steptime.optimizer_seconds(fp32, steptime.gpu()) - steptime.optimizer_seconds(bf16, steptime.gpu()) == \
        pytest.approx(saved)


# The hosts' DRAM: DGX H100 two Xeon 8480C, DGX B200 two Xeon 8570, 8 DDR5 channels of 8 bytes each; a Grace CPU's
# LPDDR5X 512 GB/s for two GPUs of a GB200 NVL72.
DDR5_CHANNELS, CHANNEL_BYTES, SOCKETS, GRACE = 8, 8, 2, 512e9


@pytest.mark.parametrize("name, per_gpu", [
    ("h100", SOCKETS * DDR5_CHANNELS * 4800e6 * CHANNEL_BYTES / 8),
    ("b200", SOCKETS * DDR5_CHANNELS * 5600e6 * CHANNEL_BYTES / 8),
    ("gb200", GRACE / 2)])
def test_host_memory_is_the_cpus_dram_peak_over_the_gpus_that_share_it(name, per_gpu):
    assert steptime.gpu(name).host_memory == pytest.approx(per_gpu, rel=1e-12)


def _shard_params() -> float:
    """The trainable parameters of :func:`settings` (layers, embedding and output layer) on one rank of TP 2, DP 2."""
    return (L * (H * 3 * H + H * H + 2 * H * FFN) + 2 * V * H) // 2 / 2


@pytest.mark.parametrize("overlap", [False, True])
def test_the_offloaded_optimizer_steps_its_share_on_the_host_and_crosses_the_host_link(overlap):
    """Half the shard on the host: 4 B of fp32 gradient down and 4 B of fp32 parameter up over PCIe (one direction,
    64 GB/s), 28 B of Adam's traffic at the host's 76.8 GB/s; the GPU steps the other half (30 B at HBM) meanwhile.
    Without the overlap the copies bracket the steps; with it the slowest of the four paces the step."""
    host = 0.5 * _shard_params()
    down = up = 4 * host / (PCIE5_BOTH / 2)
    cpu = 28 * host / (SOCKETS * DDR5_CHANNELS * 4800e6 * CHANNEL_BYTES / 8)
    gpu = 30 * (_shard_params() - host) / H100_HBM
    expected = max(down, cpu, gpu, up) if overlap else down + max(cpu, gpu) + up
    s = settings(dp=2, optimizer_offload=0.5, optimizer_offload_overlap=overlap)
    assert steptime.step_time(s, H100).optimizer == pytest.approx(expected, rel=1e-12)


def test_the_gpu_share_paces_the_offloaded_step_when_the_host_is_fast():
    """With a host link and host memory far faster than HBM, the step is the GPU's share: a quarter of the shard
    offloaded leaves three quarters of the plain step."""
    fast = steptime.gpu("h100", pcie=1e18, host_memory=1e18)
    plain = steptime.step_time(settings(dp=2), fast).optimizer
    offloaded = steptime.step_time(settings(dp=2, optimizer_offload=0.25), fast).optimizer
    assert offloaded == pytest.approx(0.75 * plain, rel=1e-6)
