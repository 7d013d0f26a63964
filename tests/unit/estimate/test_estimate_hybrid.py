"""The memory estimate of hybrid Mamba models (Nemotron 3 Nano's config.json, shrunk), against hand computation.

A Mamba layer's saves are recomputed from its shapes and the saved sets of mamba_ssm's kernels
(:mod:`megatron_bridge_ext.estimate.mamba` cites the lines): what its mixer keeps per microbatch is ``in_proj``'s
input (the sequence shard under SP), ``zxbcdt`` [b, s, in_proj / TP], the scan's ungated output and the gated norm's
input [b, s, d_inner / TP] each, the norm's fp32 ``rstd`` per group and row, ``out_proj``'s input [s, b, d_inner / TP],
and three fp32 vectors of a head each (``exp(A_log)`` that ``-exp`` keeps, ``A`` and ``dt_bias`` cast to fp32).
"""

from __future__ import annotations

import os

import pytest

from megatron_bridge_ext.estimate import configs, mamba, mamba_unfused, memory
from megatron_bridge_ext.estimate.trace import CATEGORIES, MAMBA, category_of
from tests.support.estimate import DATA
from tests.support.estimate import assert_reduced_equals_whole

pytestmark = [pytest.mark.unit]

NANO = os.path.join(DATA, "nemotron-3-nano-30b-a3b", "config.json")
BF16, FP32 = 2, 4
H, HEADS, HEAD_DIM, GROUPS, STATE, CHUNK, SEQ = 64, 8, 16, 2, 16, 32, 128


def _tiny(*, tp=2, ep=2, dp=2, pattern="MEM*-", peft="none", seq=SEQ, extra=()):
    """Nemotron 3 Nano's config.json shrunk: Mamba-2 mixers, squared-ReLU MoE with a shared expert, GQA attention."""
    layout = configs.Layout(tp=tp, ep=ep, dp=dp, seq=seq, peft=peft, lora_dim=8, lora_alpha=8)
    overrides = [f"model.num_layers={len(pattern)}", f"model.hybrid_layer_pattern={pattern}", f"model.hidden_size={H}",
                 f"model.mamba_num_heads={HEADS}", f"model.mamba_head_dim={HEAD_DIM}",
                 f"model.mamba_num_groups={GROUPS}", f"model.mamba_state_dim={STATE}",
                 f"model.mamba_chunk_size={CHUNK}", "model.num_attention_heads=4", "model.num_query_groups=2",
                 "model.kv_channels=16", "model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=32",
                 "model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_shared_expert_intermediate_size=48",
                 "model.vocab_size=512", "model.moe_token_dispatcher_type=alltoall", *extra]
    return configs.from_hf_config(NANO, layout, overrides)


def _mamba_layer_bytes(*, tp: int, seq: int = SEQ, batch: int = 1, sp: bool = True) -> int:
    heads, groups = HEADS // tp, GROUPS // tp
    inner = heads * HEAD_DIM
    in_proj = 2 * inner + 2 * groups * STATE + heads
    proj_input = BF16 * (seq // tp if sp else seq) * batch * H
    return (proj_input + BF16 * batch * seq * (in_proj + 3 * inner) + FP32 * groups * seq * batch
            + 3 * FP32 * heads)


@pytest.mark.parametrize("tp, ep, dp", [(2, 2, 2), (1, 2, 2)])
def test_a_mamba_layer_saves_what_its_kernels_and_core_keep(tp, ep, dp):
    est = memory.estimate(_tiny(tp=tp, ep=ep, dp=dp))
    assert est.activations_per_microbatch[MAMBA] == 2 * _mamba_layer_bytes(tp=tp, sp=tp > 1)


def test_the_micro_batch_scales_the_mamba_saves_through_the_copies_core_makes():
    """With b > 1 the transposes before and after the scan copy (``.contiguous()``): the scan and the gated norm
    keep those copies, the same bytes as the views at b = 1."""
    cfg = _tiny()
    cfg.train.micro_batch_size = 2
    est = memory.estimate(cfg)
    assert est.activations_per_microbatch[MAMBA] == 2 * _mamba_layer_bytes(tp=2, batch=2)


def _unfused_layer_bytes(*, tp: int, batch: int = 1) -> int:
    """A Mamba layer on Core's unfused path (``use_mamba_mem_eff_path=False``), from the kernels' saved sets
    (:mod:`megatron_bridge_ext.estimate.mamba_unfused`): the convolution keeps its transposed input [b, conv, l];
    the chunked scan its output, x and dt, B and C (Core's contiguous copies), fp32 ``dA_cumsum`` [b, heads,
    chunks, chunk], ``A`` and ``dt_bias``; the gated norm its input (the scan's output itself at b = 1, the
    transpose's copy beyond), the gate z [l, b, d_inner] and fp32 ``rstd``; ``out_proj`` its input."""
    heads, groups = HEADS // tp, GROUPS // tp
    inner, conv = heads * HEAD_DIM, heads * HEAD_DIM + 2 * groups * STATE
    padded = -(-SEQ // CHUNK) * CHUNK
    proj_input = BF16 * SEQ // tp * batch * H
    norm_input_copy = inner if batch > 1 else 0
    scan = 2 * inner + heads + 2 * groups * STATE  # out, x, dt, B, C
    return (proj_input + BF16 * batch * SEQ * (conv + scan + norm_input_copy + inner + inner)  # + z, out_proj input
            + FP32 * batch * heads * padded + FP32 * groups * SEQ * batch + 3 * FP32 * heads)


@pytest.mark.parametrize("tp, ep, dp, batch", [(2, 2, 2, 1), (1, 2, 2, 1), (2, 2, 2, 2)])
def test_the_unfused_mamba_path_saves_what_its_three_kernels_and_core_keep(tp, ep, dp, batch):
    cfg = _tiny(tp=tp, ep=ep, dp=dp, extra=["model.use_mamba_mem_eff_path=False"])
    cfg.train.micro_batch_size = batch
    est = memory.estimate(cfg)
    assert est.activations_per_microbatch[MAMBA] == 2 * _unfused_layer_bytes(tp=tp, batch=batch)


D_CONV = 4
"""``MambaMixer``'s convolution width (Core's default ``d_conv``; the hybrid specs pass none)."""


def _cp_layer_bytes(*, tp: int, cp: int, unfused: bool) -> int:
    """A Mamba layer under CP (micro-batch 1): the rank's s / CP tokens reach ``in_proj`` and leave ``out_proj``;
    between them Core's all-to-all hands the scan the whole sequence on heads / CP (groups / CP, or one repeated
    group per rank), and hands the norm back [s / CP, d_inner / TP]. The convolution's weight and bias slices are
    concatenated copies (``_slice_conv_param``), kept by the kernel that convolves."""
    local = SEQ // cp
    heads_tp, groups_tp = HEADS // tp, GROUPS // tp
    heads, groups = heads_tp // cp, max(groups_tp // cp, 1)
    inner, bc = heads * HEAD_DIM, 2 * groups * STATE
    conv = inner + bc
    padded = -(-SEQ // CHUNK) * CHUNK
    kept = BF16 * local // tp * H + BF16 * conv * (D_CONV + 1) + 3 * FP32 * heads
    if unfused:  # the transposed x, B, C; out, x, dt, B, C; dA_cumsum; the gate back on the rank's tokens
        kept += BF16 * SEQ * (conv + 2 * inner + heads + bc) + FP32 * heads * padded + BF16 * local * heads_tp * HEAD_DIM
    else:  # zxbcdt and out_x
        kept += BF16 * SEQ * (2 * inner + bc + heads + inner)
    return kept + 2 * BF16 * local * heads_tp * HEAD_DIM + FP32 * groups_tp * local  # norm input, out_proj's, rstd


@pytest.mark.parametrize("tp, cp", [(2, 2), (1, 2), (1, 4)])
@pytest.mark.parametrize("unfused", [False, True])
def test_context_parallel_mamba_layers_scan_the_whole_sequence_on_their_share_of_heads(tp, cp, unfused):
    extra = [f"model.context_parallel_size={cp}", f"model.use_mamba_mem_eff_path={not unfused}"]
    est = memory.estimate(_tiny(tp=tp, ep=1, dp=1, pattern="MM", extra=extra))
    assert est.activations_per_microbatch[MAMBA] == 2 * _cp_layer_bytes(tp=tp, cp=cp, unfused=unfused)


def test_the_scan_backward_under_cp_runs_at_the_whole_sequence_on_heads_over_cp():
    cfg = _tiny(tp=1, ep=1, dp=1, pattern="MM", seq=1024, extra=["model.context_parallel_size=4"])
    shapes = mamba.shapes(cfg.model)
    assert shapes == mamba.MambaShapes(HEADS // 4, HEAD_DIM, 1, STATE, CHUNK)
    layer = memory.estimate(cfg).component("layer backward")
    assert layer.bytes == mamba.backward_bytes(shapes, seq=1024, micro_batch=1, element=BF16, state_element=BF16)


@pytest.mark.parametrize("tp, cp, message", [
    (2, 8, "CP=8 does not divide the 4 Mamba heads of a TP rank"),
    (1, 3, "CP=3 and the 2 Mamba groups of a TP rank do not divide one another"),
])
def test_a_cp_that_does_not_split_the_mamba_heads_or_groups_is_a_layout_problem(tp, cp, message):
    model = _tiny(tp=tp, ep=1, dp=1).model
    model.context_parallel_size = cp
    assert message in [p.message for p in memory.parallel_problems(model, micro_batch=1)]


def test_the_reduced_trace_of_a_hybrid_stage_equals_the_whole_trace(monkeypatch):
    """First layer, then one of each kind: M E M * - traced as M E M * -; a longer pattern repeats the kinds."""
    cfg = _tiny(pattern="MEM*EMEM-E")
    reduced = memory.traced_layers(cfg.model)
    assert reduced.pattern == ["M", "E", "M", "*", "-"]
    assert reduced.sources == [0, 1, 2, 3, 1, 2, 1, 2, 4, 1]
    _assert_reduced_equals_whole(cfg, monkeypatch)


def _assert_reduced_equals_whole(cfg, monkeypatch):
    """The estimate with each stage traced by kind equals the one with every layer traced: per stage peak, per
    category and layer, per component."""
    assert_reduced_equals_whole(cfg, monkeypatch)


def test_lora_on_the_mamba_projections_leaves_their_inputs_to_the_adapters():
    """Bridge's LoRA on in_proj and out_proj: each frozen base linear keeps no input of its own (its LoRA-A holds it,
    a LoRA input), and with ``A_log`` frozen ``-exp(A_log)`` keeps nothing; the scan and the gated norm save as in
    full training."""
    lora = memory.estimate(_tiny(pattern="MM", peft="lora", extra=["++peft.target_modules=[in_proj,out_proj]"]))
    proj_inputs = BF16 * SEQ // 2 * H + BF16 * SEQ * (HEADS // 2) * HEAD_DIM
    assert lora.activations_per_microbatch[MAMBA] == 2 * (_mamba_layer_bytes(tp=2) - proj_inputs - FP32 * HEADS // 2)
    assert lora.activations_per_microbatch["lora inputs"] > 2 * proj_inputs


def test_mamba_layers_with_nothing_trainable_before_or_in_them_save_nothing():
    """LoRA on attention only, in a model of Mamba layers: no tensor there needs a gradient, so autograd keeps none."""
    lora = memory.estimate(_tiny(pattern="MM", peft="lora", extra=["++peft.target_modules=[linear_qkv]"]))
    assert lora.activations_per_microbatch[MAMBA] == 0


def _backward_tensors(*, tp: int, seq: int, batch: int = 1, element: int = BF16, state_element: int = BF16):
    """The scan backward's allocations as mamba_ssm makes them (ssd_combined.py at mamba.SOURCE_COMMIT), each as a
    shape and a dtype size, split into those alive throughout, those made and kept, and the two phases' own."""
    heads, groups = HEADS // tp, GROUPS // tp
    inner, conv = heads * HEAD_DIM, heads * HEAD_DIM + 2 * groups * STATE
    chunks = -(-seq // CHUNK)
    b, L = batch, CHUNK
    live = [((b, seq, 2 * inner + 2 * groups * STATE + heads), element),  # dzxbcdt
            ((b, seq, inner), element),  # dout
            ((b, seq, conv), element), ((b, seq, conv), element)]  # xBC_conv recomputed, dxBC
    kept = [((b, seq, heads), element), ((b, seq, heads, HEAD_DIM), element),  # dt_in, dout_x
            ((b, heads, chunks, L), FP32), ((b, heads, chunks, L), FP32),  # dA_cumsum, dt
            ((b, chunks, groups, L, L), FP32)]  # CB
    states = (b, chunks, heads, HEAD_DIM, STATE)
    passing = [(states, FP32), (states, FP32), (states, state_element), (states, state_element)]
    late = [(states, state_element), (states, state_element), ((b, chunks, groups, L, L), FP32),
            *[((b, heads, chunks, L), FP32)] * 4, ((b, seq, groups, STATE), FP32), ((b, seq, groups, STATE), FP32)]
    return live, kept, passing, late


def _nbytes(tensors) -> int:
    total = 0
    for shape, size in tensors:
        n = size
        for dim in shape:
            n *= dim
        total += n
    return total


@pytest.mark.parametrize("tp, seq", [(1, 128), (2, 128), (2, 100)])
def test_the_scan_backward_transient_is_the_sum_of_its_allocations(tp, seq):
    live, kept, passing, late = _backward_tensors(tp=tp, seq=seq)
    expected = _nbytes(live) + _nbytes(kept) + max(_nbytes(passing), _nbytes(late))
    shapes = mamba.MambaShapes(HEADS // tp, HEAD_DIM, GROUPS // tp, STATE, CHUNK)
    assert mamba.backward_bytes(shapes, seq=seq, micro_batch=1, element=BF16, state_element=BF16) == expected


def test_the_estimate_prices_a_mamba_stage_backward_with_the_scan_when_it_is_the_largest():
    """A long sequence against small MLPs and experts: the scan's chunk states dominate the layer backward."""
    cfg = _tiny(pattern="MM*", seq=1024)
    est = memory.estimate(cfg)
    layer = est.component("layer backward")
    shapes = mamba.shapes(cfg.model)
    assert shapes == mamba.MambaShapes(HEADS // 2, HEAD_DIM, GROUPS // 2, STATE, CHUNK)
    assert layer.bytes == mamba.backward_bytes(shapes, seq=1024, micro_batch=1, element=BF16, state_element=BF16)
    assert "Mamba scan" in layer.basis


def test_mamba_modules_and_hybrid_norms_have_their_categories():
    assert category_of("decoder.layers.0.mixer") == MAMBA
    assert category_of("decoder.layers.0.mixer.in_proj") == MAMBA
    assert category_of("decoder.layers.0.mixer.norm") == MAMBA
    assert category_of("decoder.layers.0.mixer.in_proj.adapter.linear_in") == "lora inputs"
    assert category_of("decoder.layers.0.norm") == "norms"
    assert category_of("decoder.final_norm") == "norms"
    assert MAMBA in CATEGORIES


def test_every_pipeline_stage_of_a_hybrid_model_is_a_candidate_and_traces_its_own_segment():
    """``M|MMM|M`` on PP 3: Core gives each stage one segment. The middle stage holds 3 Mamba layers with 2
    microbatches in flight (1F1B: PP - stage), more than the first (1 layer, 3 in flight) or the last (1 layer and
    the loss): it is the one reported, with its own layers' saves."""
    cfg = _tiny(dp=1, pattern="M|MMM|M", extra=["model.pipeline_model_parallel_size=3", "model.num_layers=5"])
    cfg.train.global_batch_size = 8
    est = memory.estimate(cfg)
    assert sorted(est.stage_peaks) == [0, 1, 2]
    assert est.stage == 1 and est.in_flight_microbatches == 2
    assert est.settings.hybrid.layers == {"Mamba": 3} and est.settings.layers_on_stage == 3
    assert est.activations_per_microbatch[MAMBA] == 3 * _mamba_layer_bytes(tp=2)


def test_a_hybrid_stage_is_reduced_by_the_kinds_of_its_own_segment():
    cfg = _tiny(dp=1, pattern="MEM*E|M-MEM", extra=["model.pipeline_model_parallel_size=2", "model.num_layers=10"])
    first, second = memory.traced_layers(cfg.model, 0), memory.traced_layers(cfg.model, 1)
    assert (first.pattern, first.sources) == (["M", "E", "M", "*"], [0, 1, 2, 3, 1])
    assert (second.pattern, second.sources) == (["M", "-", "M", "E"], [0, 1, 2, 3, 2])


@pytest.mark.parametrize("fields, segments", [
    ({"hybrid_layer_pattern": "MM*|M-/E"}, ["MM*", "M-"]),  # '|' marks the stages; '/' starts the MTP layers
    ({"hybrid_layer_pattern": "MM*M-E"}, ["MM*", "M-E"]),  # no marks: an even split
    ({"hybrid_layer_pattern": "MM*M-E", "num_layers_in_first_pipeline_stage": 2}, ["MM", "*M-E"]),
    ({"hybrid_layer_pattern": "MM*M-E", "num_layers_in_last_pipeline_stage": 1}, ["MM*M-", "E"]),
])
def test_pipeline_segments_follow_cores_split(fields, segments):
    from types import SimpleNamespace

    from megatron_bridge_ext.estimate import unmodelled

    model = SimpleNamespace(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=None,
                            num_layers_in_last_pipeline_stage=None)
    model.__dict__.update(fields)
    assert unmodelled.pipeline_segments(model) == segments


def test_the_reduced_trace_of_a_hybrid_pipeline_stage_equals_its_whole_trace(monkeypatch):
    cfg = _tiny(dp=1, pattern="MEM*E|M-MEM", extra=["model.pipeline_model_parallel_size=2", "model.num_layers=10"])
    cfg.train.global_batch_size = 4
    _assert_reduced_equals_whole(cfg, monkeypatch)


def test_a_pattern_whose_segments_are_not_the_pipeline_stages_is_a_layout_problem():
    cfg = _tiny(dp=1, pattern="MM|M*|-", extra=["model.pipeline_model_parallel_size=2", "model.num_layers=5"])
    problems = memory.parallel_problems(cfg.model, micro_batch=1)
    assert [p.setting for p in problems] == ["model.hybrid_layer_pattern"]
    assert "3 pipeline segments" in problems[0].message


def test_a_tp_that_does_not_divide_the_mamba_groups_is_a_layout_problem():
    problems = memory.parallel_problems(_tiny(tp=4, ep=1, dp=1).model, micro_batch=1)
    assert any(p.message == "TP=4 does not divide the 2 Mamba groups" for p in problems)


def test_tp_without_sequence_parallelism_on_moe_is_refused_as_core_refuses_it():
    cfg = _tiny(extra=["model.sequence_parallel=False"])
    problems = memory.parallel_problems(cfg.model, micro_batch=1)
    assert [p.setting for p in problems] == ["model.sequence_parallel"]


def test_the_stand_ins_compute_nothing_on_real_tensors_and_refuse_other_calls():
    import torch

    x = torch.zeros(1, 4, 2 * 16 + 2 * 8 + 1)
    with pytest.raises(RuntimeError, match="fake tensors only"):
        mamba.split_conv1d_scan_combined(x, torch.zeros(24, 4), torch.zeros(24), torch.zeros(1), torch.zeros(1),
                                         torch.zeros(1), 4, headdim=16, ngroups=1)
    with pytest.raises(NotImplementedError, match="initial_states"):
        mamba.split_conv1d_scan_combined(x, None, None, None, None, None, 4, initial_states=x, headdim=16)
    with pytest.raises(RuntimeError, match="fake tensors only"):
        mamba.GatedRMSNorm(16)(torch.zeros(2, 16), z=torch.zeros(2, 16))
    with pytest.raises(RuntimeError, match="fake tensors only"):
        mamba_unfused.causal_conv1d_fn(torch.zeros(1, 24, 4), torch.zeros(24, 4), torch.zeros(24), activation="silu")
    with pytest.raises(NotImplementedError, match="seq_idx"):
        mamba_unfused.causal_conv1d_fn(x, None, seq_idx=x)
    with pytest.raises(NotImplementedError, match="return_final_states"):
        mamba_unfused.chunk_scan_combined(x, None, None, None, None, 4, return_final_states=True)


def test_the_kernels_are_put_back_after_the_trace():
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.ssm import mamba_mixer

    def kernels():
        return (mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.ExtendedRMSNorm, mamba_mixer.mamba_split_conv1d_scan_combined,
                mamba_mixer.causal_conv1d_fn, mamba_mixer.mamba_chunk_scan_combined, hybrid_block.TENorm)

    before = kernels()
    with mamba.mamba_kernels():
        assert mamba_mixer.mamba_split_conv1d_scan_combined is mamba.split_conv1d_scan_combined
        assert mamba_mixer.mamba_chunk_scan_combined is mamba_unfused.chunk_scan_combined
    memory.estimate(_tiny(pattern="M*"))
    assert kernels() == before


def test_te_keeps_a_norm_output_shard_beside_lora_a_on_its_layernorm_linears_only():
    """Under SP, Bridge's LoRA-A on a TE LayerNormLinear keeps the gathered norm output and TE its own shard
    [s/t, b, h]: in_proj (two Mamba layers), linear_qkv (one attention layer) and the MLP layer's linear_fc1; not the
    MoE layer's shared-expert linear_fc1, a plain TEColumnParallelLinear after the MoE layer's own norm."""
    cfg = _tiny(peft="lora", extra=["++peft.target_modules=[linear_qkv,linear_fc1,in_proj]"])
    est = memory.estimate(cfg)
    shard = BF16 * (SEQ // 2) * H
    assert est.component("TE norm-output shards (contract)").bytes == 4 * shard
    assert "4 LayerNormLinear(s)" in est.component("TE norm-output shards (contract)").basis


FP8_MAMBA = ("model.mamba_num_heads=16", "model.mamba_head_dim=8")
"""Under FP8 Core asserts in_proj's width is a multiple of 16 (mamba_mixer.py L251-255): 2 x 128 + 2 x 2 x 16 + 16."""
FP8_RECIPES = {"tensorwise": ("bf16_with_fp8_current_scaling_mixed", [1, 3]),
               "mxfp8": ("bf16_with_mxfp8_mixed", [0, 1, 3, 5])}
"""Pattern MM*M-M: the Mamba layers that run in FP8 (current scaling keeps the first and the last layer in bf16)."""
_FP8_CACHE = {}


def _fp8_hybrid(recipe):
    """TP 2 with SP, sequence 128: per TP rank a Mamba mixer of 8 heads of 8 (inner 64), 1 group, in_proj 168 wide."""
    if recipe not in _FP8_CACHE:
        _FP8_CACHE[recipe] = memory.estimate(_tiny(pattern="MM*M-M", extra=FP8_MAMBA + (
            f"mixed_precision={FP8_RECIPES[recipe][0]}",)))
    return _FP8_CACHE[recipe]


def _quantised(rows, cols, recipe, usage):
    """One quantised input: 1 B per element, an fp32 scale (float8_tensor.py L92-126), or MXFP8's E8M0 scales, padded
    to 128 x 4 rowwise [rows, cols / 32] or columnwise [rows / 32, cols] (mxfp8_tensor.py L101-119)."""
    if recipe != "mxfp8":
        return rows * cols + 4
    if usage == "rowwise":
        return rows * cols + -(-rows // 128) * 128 * -(-(cols // 32) // 4) * 4
    return rows * cols + -(-(rows // 32) // 4) * 4 * -(-cols // 128) * 128


@pytest.mark.parametrize("recipe", list(FP8_RECIPES))
def test_fp8_mamba_projections_keep_quantised_inputs_in_place_of_the_bf16_ones(recipe):
    """in_proj (TE LayerNormLinear) keeps its norm-output shard [128 / 2, 64] quantised, rowwise under SP with
    Float8 scaling, columnwise with MXFP8; out_proj (TE Linear) its input [128, 64] columnwise; neither bf16 copy the
    local spec's separate norm and linears keep stays (te_fp8.py's contract, as for linear_qkv and linear_fc2)."""
    est = _fp8_hybrid(recipe)
    shard, inner = (SEQ // 2, H), (SEQ, 16 * 8 // 2)
    usage = "columnwise" if recipe == "mxfp8" else "rowwise"
    per_layer = (_quantised(*shard, recipe, usage) + _quantised(*inner, recipe, "columnwise")
                 - BF16 * (shard[0] * shard[1] + inner[0] * inner[1]))
    traced = est.activations_per_microbatch[MAMBA]
    assert est.component(MAMBA).bytes - traced == len(FP8_RECIPES[recipe][1]) * per_layer


def test_fp8_weights_count_the_mamba_projections_of_the_fp8_layers_by_global_number():
    """Six layers traced as four (M M * -): the FP8 layers 1 to 4 by their global numbers; per TP rank in_proj
    [336 / 2, 64], out_proj [64, 64], linear_qkv [(4 + 2 x 2) x 16 / 2, 64], linear_proj [64, 32], the MLP's
    linear_fc1 [96 / 2, 64] and linear_fc2 [64, 48], each 2 B per element (data and transpose) and an fp32 scale."""
    est = _fp8_hybrid("tensorwise")
    mamba_layer = (2 * 168 * 64 + 4) + (2 * 64 * 64 + 4)
    attention_layer = (2 * 64 * 64 + 4) + (2 * 64 * 32 + 4)
    mlp_layer = 2 * (2 * 48 * 64 + 4)
    assert est.component("weights: FP8 linear weights").bytes == 2 * mamba_layer + attention_layer + mlp_layer


def test_the_reduced_trace_of_an_fp8_hybrid_stage_equals_the_whole_trace(monkeypatch):
    """MM*M-M traced as M M * - under FP8 current scaling: the FP8 layers, weights and contract by global number."""
    _assert_reduced_equals_whole(_tiny(pattern="MM*M-M", extra=FP8_MAMBA + (
        "mixed_precision=bf16_with_fp8_current_scaling_mixed",)), monkeypatch)
