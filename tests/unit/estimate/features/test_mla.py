"""Multi-latent attention in the estimate: parameters per rank from the shapes, what Transformer Engine's layout
saves against the local spec's (whose trace equals the meter on Core's real layer: tests/functional/
test_estimate_grid.py), what ``mla_up_proj`` recompute saves, the stand-ins and the variants refused by name.

The tiny model: h 64, 4 heads, kv_lora_rank 16, qk_head_dim 16, qk_pos_emb_head_dim 8, v_head_dim 12, q_lora_rank 24
or None, sequence 32, micro-batch 2, fp32 (4 B per element)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate.features import mla

pytestmark = [pytest.mark.unit]

H, HEADS, KV, NOPE, ROPE, V, Q_LORA = 64, 4, 16, 16, 8, 12, 24
SEQ, BATCH, E = 32, 2, 4
LOCAL, TE = "local", mla.TRANSFORMER_ENGINE
UP_PROJ = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"])


def _shape(*, tp: int, q_lora, qk_layernorm: bool, sp: bool = True):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

    return TinyGPTShape(tp=tp, sequence_parallel=sp, heads=HEADS, kv_heads=HEADS, mla=True, q_lora_rank=q_lora,
                        kv_lora_rank=KV, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V,
                        qk_layernorm=qk_layernorm, seq=SEQ, micro_batch=BATCH, hidden=H, dtype="float32")


def _attention_parameters(shape, impl: str) -> dict[str, int]:
    """The parameters of layer 0's attention on TP rank 0, as the estimate builds the rank (name -> elements)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.estimate.build import FUSED, build_rank_model
    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    prepared = memory.prepare(tiny_config(shape), data_parallel_size=1, num_microbatches=1)
    with fake_parallel_world(tp=shape.tp, pp=1, cp=1, rank=0, device="cpu"):
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        model = build_rank_model(copy.deepcopy(prepared.provider), None, attention=FUSED, mode=mode, device="cpu",
                                 dtype=torch.float32, transformer_impl=impl)
    prefix = "decoder.layers.0.self_attention."
    return {name[len(prefix):]: p.numel() for name, p in model.named_parameters() if name.startswith(prefix)}


def _layer_bytes(shape, impl: str, **recompute) -> int:
    """What layer 1 of the tiny model saves per microbatch in the estimate's trace."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    est = estimate(tiny_config(shape, None, **recompute), attention="fused", transformer_impl=impl, device="cpu")
    assert est.settings.mla is not None and est.settings.transformer_impl == impl
    return est.activations_per_layer[1]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("q_lora, impl", [(None, LOCAL), (Q_LORA, LOCAL), (None, TE), (Q_LORA, TE)])
def test_attention_parameters_per_rank_follow_the_shapes(tp, q_lora, impl):
    """Column-parallel up projections and row-parallel output projection split over TP; the down projections
    split too on the local spec and whole on every rank in TE's layout (TELinear, duplicated); the query and
    key-value latent norms standalone on the local spec and inside the up projections in TE's layout, where a
    query norm over the hidden size sits in linear_q_proj when there is no query latent (Core's resolver)."""
    qk_layernorm = not (q_lora is None and impl == LOCAL)  # Core's local spec cannot build that query norm
    te = impl == TE
    down_split = 1 if te else tp
    q_head = NOPE + ROPE
    fused = te and qk_layernorm  # TE's fused norm-linear: our stand-in's norm and linear
    up = "linear.weight" if fused else "weight"
    expected = {"linear_proj.weight": H * HEADS * V // tp}
    if q_lora is None:
        expected[f"linear_q_proj.{up}"] = HEADS * q_head * H // tp
        if fused:
            expected["linear_q_proj.layernorm.weight"] = H
    else:
        expected["linear_q_down_proj.weight"] = Q_LORA * H // down_split
        expected[f"linear_q_up_proj.{up}"] = HEADS * q_head * Q_LORA // tp
        expected["linear_q_up_proj.layernorm.weight" if fused else "q_layernorm.weight"] = Q_LORA
    expected["linear_kv_down_proj.weight"] = (KV + ROPE) * H // down_split
    expected[f"linear_kv_up_proj.{up}"] = HEADS * (NOPE + V) * KV // tp
    if qk_layernorm:
        expected["linear_kv_up_proj.layernorm.weight" if fused else "kv_layernorm.weight"] = KV
    assert _attention_parameters(_shape(tp=tp, q_lora=q_lora, qk_layernorm=qk_layernorm), impl) == expected


def test_te_layout_keeps_the_shard_where_the_local_scatter_keeps_the_gathered_query_latent():
    """TP 2 with SP: the local spec's query latent is gathered over TP and scattered back as a slice of the gathered
    tensor (mappings.py L79), which its norm keeps: s x b x q_lora_rank where TE's duplicated down projection makes
    the shard, s/t x b x q_lora_rank. TE's key-value latent is a split of its own down projection's output, which its
    norm keeps whole (the positional part with it: s/t x b x qk_pos_emb_head_dim more), where the local spec's scatter
    copies the latent out. Without SP both keep the same."""
    tokens = SEQ // 2 * BATCH
    gathered_query = (SEQ - SEQ // 2) * BATCH * Q_LORA * E
    positional_key = tokens * ROPE * E
    sp = _shape(tp=2, q_lora=Q_LORA, qk_layernorm=True)
    assert _layer_bytes(sp, TE) - _layer_bytes(sp, LOCAL) == positional_key - gathered_query
    no_sp = _shape(tp=2, q_lora=Q_LORA, qk_layernorm=True, sp=False)
    assert _layer_bytes(no_sp, TE) == _layer_bytes(no_sp, LOCAL)


def test_te_layout_without_a_query_latent_norms_the_hidden_state_in_the_query_projection():
    """Core's resolver fuses a norm over the hidden size into linear_q_proj when q_lora_rank is None
    (mla_qk_norm_config.py L147-150): with qk_layernorm the query and key-value norms each keep their fp32 rstd [T]
    and their normalised input (RMSNorm's x / rms), and each up projection keeps the norm's output instead of its
    input (T = s/t x b tokens; the norms' inputs are kept without them too)."""
    tokens = SEQ // 2 * BATCH
    norms = 2 * tokens * 4 + tokens * H * E + tokens * KV * E
    outputs = tokens * H * E + tokens * KV * E
    with_norms = _layer_bytes(_shape(tp=2, q_lora=None, qk_layernorm=True), TE)
    assert with_norms - _layer_bytes(_shape(tp=2, q_lora=None, qk_layernorm=False), TE) == norms + outputs


@pytest.mark.parametrize("q_lora", [None, Q_LORA])
def test_mla_up_proj_keeps_the_latents_and_releases_query_key_and_value(q_lora):
    """TE's layout at TP 2 with SP: recomputing the up projections drops what they and RoPE keep (each norm's rstd
    and normalised input, each linear's input, cos and sin for the query and the key) and the query, key and value
    core attention kept (Core releases them, multi_latent_attention.py L454-457), and keeps the checkpoint's
    inputs that nothing kept before: the gathered positional key part [s, b, rope] and the rotary frequencies
    [s, 1, 1, rope] in fp32 (the latents were kept by the norms already)."""
    tokens, local_heads = SEQ // 2 * BATCH, HEADS // 2
    query_in = H if q_lora is None else q_lora
    norms_and_linears = (tokens * 4 + 2 * tokens * query_in * E) + (tokens * 4 + 2 * tokens * KV * E)
    rope = 4 * SEQ * ROPE * E
    qkv = SEQ * BATCH * local_heads * (2 * (NOPE + ROPE) + V) * E
    checkpoint_inputs = SEQ * BATCH * ROPE * E + SEQ * ROPE * 4
    shape = _shape(tp=2, q_lora=q_lora, qk_layernorm=True)
    saving = _layer_bytes(shape, TE) - _layer_bytes(shape, TE, **UP_PROJ)
    assert saving == norms_and_linears + rope + qkv - checkpoint_inputs


def test_duplicated_linear_keeps_its_input_only_while_its_weight_trains():
    from megatron_bridge_ext.measure import SavedActivationMeter

    config = SimpleNamespace(params_dtype=torch.float32)
    linear = mla.DuplicatedLinear(8, 6, parallel_mode="duplicated", config=config, init_method=None, bias=False,
                                  skip_bias_add=False, is_expert=False)
    assert tuple(linear.weight.shape) == (6, 8)
    with torch.no_grad():  # init_method None leaves the weight as torch.empty left it: set values to compare against
        linear.weight.copy_(torch.randn(6, 8))
    x = torch.randn(5, 2, 8, requires_grad=True)
    with SavedActivationMeter(linear) as meter:
        out, bias = linear(x)
    assert tuple(out.shape) == (5, 2, 6) and bias is None
    assert meter.result().total_bytes == 5 * 2 * 8 * 4
    out.sum().backward()
    assert torch.allclose(x.grad, linear.weight.sum(0).expand(5, 2, 8))
    linear.weight.requires_grad_(False)
    with SavedActivationMeter(linear) as meter:
        linear(x)
    assert meter.result().total_bytes == 0


def test_duplicated_linear_refuses_what_core_never_asks_of_it():
    config = SimpleNamespace(params_dtype=torch.float32)
    for changed in (dict(parallel_mode=None), dict(bias=True), dict(is_expert=True)):
        arguments = dict(parallel_mode="duplicated", config=config, init_method=None, bias=False, skip_bias_add=False,
                         is_expert=False) | changed
        with pytest.raises(ValueError, match="TELinear.s duplicated mode without bias, outside the experts"):
            mla.DuplicatedLinear(8, 6, **arguments)


def test_te_modules_put_cores_names_back():
    from megatron.core.extensions import transformer_engine_spec_provider as te_spec
    from megatron.core.transformer import mla_qk_norm_config, multi_latent_attention

    keys = ((multi_latent_attention, "TELinear"), (te_spec, "TELayerNormColumnParallelLinear"),
            (mla_qk_norm_config, "get_backend"))
    before = [getattr(*key) for key in keys]
    with mla.te_modules():
        assert multi_latent_attention.TELinear is mla.DuplicatedLinear
        assert mla_qk_norm_config.get_backend("local").column_parallel_layer_norm_linear() is \
            mla.NormColumnParallelLinear
    assert [getattr(*key) for key in keys] == before


def _model(**fields):
    base = dict(multi_latent_attention=True, experimental_attention_variant=None, mla_down_proj_fusion=False,
                fp8=None, hybrid_layer_pattern=None, hybrid_override_pattern=None, tensor_model_parallel_size=2,
                q_lora_rank=Q_LORA, kv_lora_rank=KV, qk_pos_emb_head_dim=ROPE, qk_layernorm=True,
                apply_rope_fusion=False, rope_type="yarn")
    return SimpleNamespace(**(base | fields))


def test_a_model_without_multi_latent_attention_raises_nothing():
    model = _model(multi_latent_attention=False, experimental_attention_variant="dsa", fp8="hybrid", q_lora_rank=7,
                   apply_rope_fusion=True)
    assert mla.findings(model) == []
    assert mla.layout_findings(model, transformer_impl=LOCAL) == []
    assert mla.trace_findings(model, attention="local", transformer_impl=LOCAL, fused="fused") == []
    assert mla.turn_off_rope_fusion(model) is None and model.apply_rope_fusion
    assert mla.peft_findings(model, SimpleNamespace(target_modules=["linear_q_up_proj"])) == []


@pytest.mark.parametrize("fields, setting", [
    (dict(mla_down_proj_fusion=True), "model.mla_down_proj_fusion"),
    (dict(fp8="hybrid"), "model.fp8"),
    (dict(hybrid_layer_pattern="M*"), "model.multi_latent_attention"),
])
def test_variants_not_modelled_are_named(fields, setting):
    assert mla.findings(_model()) == []
    [finding] = mla.findings(_model(**fields))
    assert finding.setting == setting and "not modelled" in finding.message and finding.fix


def test_lora_on_the_latent_projections_is_traced_and_other_adapters_refused():
    model = _model()
    assert mla.peft_findings(model, None) == []
    assert mla.peft_findings(model, _lora("linear_kv_up_proj", "linear_q_down_proj")) == []
    assert mla.peft_findings(model, SimpleNamespace(target_modules=["linear_qkv", "linear_proj", "linear_fc1"])) == []
    [finding] = mla.peft_findings(model, SimpleNamespace(target_modules=["linear_kv_up_proj", "linear_q_down_proj"]))
    assert finding.setting == "peft.target_modules"
    assert "linear_kv_up_proj, linear_q_down_proj" in finding.message


R, TP = 4, 2
"""LoRA rank, and the TP size of the LoRA tests (with SP)."""
LORA_SHAPES = {  # projection -> (q_lora_rank, its input width, its output width, fused norm before it)
    "linear_q_proj": (None, H, HEADS * (NOPE + ROPE), True),
    "linear_q_down_proj": (Q_LORA, H, Q_LORA, False),
    "linear_q_up_proj": (Q_LORA, Q_LORA, HEADS * (NOPE + ROPE), True),
    "linear_kv_down_proj": (Q_LORA, H, KV + ROPE, False),
    "linear_kv_up_proj": (Q_LORA, KV, HEADS * (NOPE + V), True),
}


def _lora(*targets):
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.peft.lora import LoRA

    return LoRA(target_modules=["linear_proj", *targets], dim=R, alpha=2 * R)


def _adapter_parameters(shape, peft) -> dict[str, tuple[int, ...]]:
    """The adapters' parameter shapes in layer 0's attention on TP rank 0, in TE's layout (name -> shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.estimate.build import FUSED, build_rank_model
    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    prepared = memory.prepare(tiny_config(shape), data_parallel_size=1, num_microbatches=1)
    with fake_parallel_world(tp=shape.tp, pp=1, cp=1, rank=0, device="cpu"):
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        model = build_rank_model(copy.deepcopy(prepared.provider), peft, attention=FUSED, mode=mode, device="cpu",
                                 dtype=torch.float32, transformer_impl=TE)
    prefix = "decoder.layers.0.self_attention."
    return {name[len(prefix):]: tuple(p.shape) for name, p in model.named_parameters()
            if name.startswith(prefix) and p.requires_grad}


@pytest.mark.parametrize("projection", sorted(LORA_SHAPES))
def test_lora_on_a_latent_projection_has_bridges_adapter_shapes(projection):
    """Bridge's ParallelLinearAdapter (peft/utils.py L1006-1056): LoRA-A column-parallel over the rank
    [r/t, input], LoRA-B column-parallel over the output [output/t, r], for TE's duplicated down projections (whose
    own weight is whole on every rank) as for the column-parallel up projections; only the adapters train."""
    q_lora, width_in, width_out, _ = LORA_SHAPES[projection]
    shape = _shape(tp=TP, q_lora=q_lora, qk_layernorm=True)
    expected = {f"{projection}.adapter.linear_in.weight": (R // TP, width_in),
                f"{projection}.adapter.linear_out.weight": (width_out // TP, R),
                "linear_proj.adapter.linear_in.weight": (R, HEADS * V // TP),
                "linear_proj.adapter.linear_out.weight": (H // TP, R)}
    assert _adapter_parameters(shape, _lora(projection)) == expected


@pytest.mark.parametrize("projection", sorted(LORA_SHAPES))
def test_lora_on_a_latent_projection_saves_its_inputs_from_the_shapes(projection):
    """What one adapter adds to a layer's saved bytes at TP 2 with SP, against LoRA on linear_proj alone (T = s/t x
    b local tokens). A duplicated down projection takes the sequence shard and Bridge neither gathers it nor
    scatters the output (TE's module has parallel_mode None, utils.py L562-564): LoRA-A keeps its input [T, h],
    LoRA-B its input [T, r] (LoRA-A's output gathered over TP). A norm-fused up projection returns its norm output
    gathered (utils.py L598-611): TE keeps the shard [T, input] beside it, LoRA-A the gathered [s x b, input],
    LoRA-B [s x b, r]."""
    q_lora, width_in, _, fused = LORA_SHAPES[projection]
    shape = _shape(tp=TP, q_lora=q_lora, qk_layernorm=True)
    tokens, gathered = SEQ // TP * BATCH, SEQ * BATCH
    expected = (tokens * width_in + gathered * width_in + gathered * R if fused else
                tokens * width_in + tokens * R) * E
    baseline = _layer_bytes_with(shape, _lora())
    assert _layer_bytes_with(shape, _lora(projection)) - baseline == expected


def _layer_bytes_with(shape, peft) -> int:
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    return estimate(tiny_config(shape, peft), attention="fused", transformer_impl=TE,
                    device="cpu").activations_per_layer[1]


def test_unfused_attention_and_a_local_query_norm_without_a_latent_are_not_modelled():
    assert mla.trace_findings(_model(), attention="fused", transformer_impl=LOCAL, fused="fused") == []
    [unfused] = mla.trace_findings(_model(), attention="local", transformer_impl=TE, fused="fused")
    assert unfused.setting == "attention" and "k_channels/v_channels" in unfused.message
    no_latent = _model(q_lora_rank=None)
    assert mla.trace_findings(no_latent, attention="fused", transformer_impl=TE, fused="fused") == []
    [norm] = mla.trace_findings(no_latent, attention="fused", transformer_impl=LOCAL, fused="fused")
    assert norm.setting == "model.qk_layernorm"
    assert mla.trace_findings(_model(q_lora_rank=None, qk_layernorm=False), attention="fused", transformer_impl=LOCAL,
                              fused="fused") == []


def test_latent_ranks_tp_does_not_divide_are_refused_on_the_local_spec_only():
    assert mla.layout_findings(_model(), transformer_impl=LOCAL) == []  # 24 and 16 + 8 on TP 2
    odd = _model(q_lora_rank=9, kv_lora_rank=15, qk_pos_emb_head_dim=8, tensor_model_parallel_size=2)
    assert [f.setting for f in mla.layout_findings(odd, transformer_impl=LOCAL)] == ["model.q_lora_rank",
                                                                                     "model.kv_lora_rank"]
    assert mla.layout_findings(odd, transformer_impl=TE) == []
    assert mla.layout_findings(_model(q_lora_rank=None, kv_lora_rank=16), transformer_impl=LOCAL) == []


def test_fused_yarn_rope_is_traced_unfused_and_said_a_plain_rope_left_for_core_to_refuse():
    model = _model(apply_rope_fusion=True)
    assert mla.turn_off_rope_fusion(model) == mla.ROPE_FUSION_NOTE and not model.apply_rope_fusion
    assert mla.turn_off_rope_fusion(model) is None  # nothing left to turn off
    plain = _model(apply_rope_fusion=True, rope_type="rope")
    assert mla.turn_off_rope_fusion(plain) is None and plain.apply_rope_fusion


def test_the_estimate_names_the_layout_it_traced_among_its_assumptions():
    assert "duplicated down projections" in mla.assumption(_model(), TE)
    assert "column-parallel down projections" in mla.assumption(_model(), LOCAL)
    assert mla.assumption(_model(multi_latent_attention=False), TE) is None
