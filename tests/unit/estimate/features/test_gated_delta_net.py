"""Gated delta net in the estimate: the fla stand-ins save what fla v0.4.2's kernels save (counted from shapes and
the cited source), Core's ``GatedDeltaNet`` traced on fake tensors saves what the saved-tensor meter counts on the
same module run on CPU with the stand-ins in place, and the layer kinds follow Core's two patterns.

The tiny model: h 64, 4 attention heads, linear attention with 2 key heads of 8 and 4 value heads of 16 (each key head
shared by two value heads), a kernel of 4, sequence 32, fp32 (4 B per element)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate.features import gated_delta_net as gdn
from megatron_bridge_ext.measure import SavedActivationMeter

pytestmark = [pytest.mark.unit]

H, KEY_HEADS, KEY_DIM, VALUE_HEADS, VALUE_DIM, KERNEL = 64, 2, 8, 4, 16, 4
SEQ, E = 32, 4
GDN_FIELDS = dict(experimental_attention_variant="gated_delta_net", linear_conv_kernel_dim=KERNEL,
                  linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, linear_num_key_heads=KEY_HEADS,
                  linear_num_value_heads=VALUE_HEADS, normalization="RMSNorm")


def _saved_bytes(fn, *inputs, parameters=()) -> int:
    """What the saved-tensor meter counts for ``fn(*inputs)`` (``parameters`` are the model's, not counted)."""
    holder = torch.nn.Module()
    for index, parameter in enumerate(parameters):
        holder.register_parameter(f"p{index}", parameter)
    with SavedActivationMeter(holder) as meter:
        out = fn(*inputs)
    result = meter.result().total_bytes
    del out
    return result


def test_the_conv_stand_in_keeps_the_storage_of_the_view_it_was_given():
    """CausalConv1dFunction saves ``x`` itself (conv/triton/ops.py L364; the guard leaves it, L342): Core hands it a
    slice of in_proj's transposed output, so the whole projection [s, b, in_proj] stays; the weight is a parameter
    and the bias None. The output is new and contiguous."""
    batch, conv, extra = 2, 40, 24
    projection = torch.randn(SEQ, batch, conv + extra, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(conv, KERNEL))

    def run(p):
        x = p.transpose(0, 1)[..., :conv]
        y, final = gdn.causal_conv1d(x, weight, None, activation="silu")
        assert final is None and tuple(y.shape) == (batch, SEQ, conv) and y.is_contiguous()
        return y

    assert _saved_bytes(run, projection, parameters=[weight]) == SEQ * batch * (conv + extra) * E


def test_the_l2norm_stand_in_keeps_its_output_and_an_fp32_rstd_per_row():
    """L2NormFunction saves y (x's shape and dtype) and rstd, fp32 over x's leading dims (l2norm.py L141, L152,
    L181, L249); x itself is not kept."""
    x = torch.randn(2, SEQ, 2 * KEY_HEADS, KEY_DIM, dtype=torch.bfloat16, requires_grad=True)
    rows = 2 * SEQ * 2 * KEY_HEADS
    assert _saved_bytes(lambda t: gdn.l2norm(t * 1), x) == rows * KEY_DIM * 2 + rows * 4


def test_the_delta_rule_stand_in_keeps_its_inputs_the_fp32_gate_cumsum_and_the_chunk_inverse():
    """ChunkGatedDeltaRuleFunction saves q, k, v and beta as given, g's chunk-local cumsum fp32 [B, T, H] and A
    [B, T, H, 64] in k's dtype (chunk.py L38-53, L261); the chunk states are recomputed in backward. o has v's
    shape in q's dtype."""
    batch, heads = 2, VALUE_HEADS
    q, k = (torch.randn(batch, SEQ, heads, KEY_DIM, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(batch, SEQ, heads, VALUE_DIM, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(batch, SEQ, heads, dtype=torch.float32, requires_grad=True)
    beta = torch.rand(batch, SEQ, heads, dtype=torch.bfloat16, requires_grad=True)

    def run(q, k, v, g, beta):
        o, final = gdn.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                              use_qk_l2norm_in_kernel=False, cu_seqlens=None)
        assert final is None and tuple(o.shape) == tuple(v.shape) and o.dtype == q.dtype
        return o

    tokens = batch * SEQ * heads
    inputs = 2 * tokens * KEY_DIM * 2 + tokens * VALUE_DIM * 2 + tokens * 2
    assert _saved_bytes(run, q, k, v, g, beta) == inputs + tokens * 4 + tokens * gdn.CHUNK * 2


@pytest.mark.parametrize("call, name", [
    (lambda t: gdn.causal_conv1d(t, torch.ones(3, KERNEL), initial_state=t), "initial_state"),
    (lambda t: gdn.causal_conv1d(t, torch.ones(3, KERNEL), cu_seqlens=torch.tensor([0, 4])), "cu_seqlens"),
    (lambda t: gdn.chunk_gated_delta_rule(t, t, t, t[..., 0], t[..., 0], output_final_state=True),
     "output_final_state"),
    (lambda t: gdn.chunk_gated_delta_rule(t, t, t, t[..., 0], t[..., 0], use_qk_l2norm_in_kernel=True),
     "use_qk_l2norm_in_kernel"),
])
def test_the_stand_ins_refuse_calls_core_does_not_make(call, name):
    with pytest.raises(NotImplementedError, match=name):
        call(torch.zeros(1, 4, 2, 3))


def test_the_kernels_are_put_back_after_the_trace():
    from megatron.core.ssm.gated_delta_net import common, gdn as core_gdn

    keys = [(common, "HAVE_FLA"), (common, "causal_conv1d"), (common, "l2norm"), (common, "chunk_gated_delta_rule"),
            (core_gdn, "causal_conv1d"), (core_gdn, "chunk_gated_delta_rule")]
    before = [getattr(*key) for key in keys]
    with gdn.kernels():
        assert core_gdn.chunk_gated_delta_rule is gdn.chunk_gated_delta_rule and common.l2norm is gdn.l2norm
    assert [getattr(*key) for key in keys] == before


def _tiny_shape(*, tp: int, micro_batch: int = 2, layers: int = 1):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

    return TinyGPTShape(tp=tp, layers=layers, hidden=H, heads=4, kv_heads=2, seq=SEQ, micro_batch=micro_batch,
                        dtype="float32", swiglu=True)


def _traced_attention_bytes(shape, pattern: list[int], **recompute) -> int:
    """What the estimate's trace counts for the attention of the tiny model with layers of ``pattern``."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    cfg = tiny_config(shape, None, linear_attention_freq=list(pattern), **GDN_FIELDS, **recompute)
    est = estimate(cfg, attention="fused", transformer_impl="local", device="cpu")
    return est.activations_per_microbatch["attention"]


def _metered_gdn_bytes(shape, **recompute) -> int:
    """The saved-tensor meter on Core's real GatedDeltaNet (the estimate's spec, the stand-ins in place) run on CPU
    in a one-rank world, its input a fresh [s, b, h] tensor as the layer's norm hands it over."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.testing.tiny_model import transformer_config

    config = transformer_config(shape, linear_attention_freq=[1] * shape.layers, **GDN_FIELDS, **recompute)
    with fake_parallel_world(tp=1, pp=1, cp=1, rank=0, device="cpu"), gdn.kernels():
        torch.manual_seed(0)
        module = build_module(gdn.gdn_attention_spec(config), config=config, layer_number=1,
                              pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        x = torch.randn(shape.seq, shape.micro_batch, H, requires_grad=True)
        with SavedActivationMeter(module) as meter:
            out, _ = module(x, attention_mask=None)
        assert tuple(out.shape) == (shape.seq, shape.micro_batch, H)
        return meter.result().total_bytes


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_a_traced_gated_delta_net_layer_saves_what_the_meter_counts_on_cores_module(micro_batch):
    """TP 1: the projections, the convolution's view of in_proj, the query-key norm, the GQA copies, g and beta,
    the stand-ins' saves and the gated output norm, traced on fake tensors, equal the meter on Core's module."""
    shape = _tiny_shape(tp=1, micro_batch=micro_batch)
    assert _traced_attention_bytes(shape, [1]) == _metered_gdn_bytes(shape)


def test_gdn_norm_out_recompute_is_traced_as_cores_module_keeps_it():
    """Selective ``gdn_norm_out`` recompute (gdn.py L255-276): the gated norm's saves are
    dropped and its inputs kept, in the trace as on Core's module; it keeps less than without it."""
    shape = _tiny_shape(tp=1)
    recompute = dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"])
    traced = _traced_attention_bytes(shape, [1], **recompute)
    assert traced == _metered_gdn_bytes(shape, **recompute)
    assert traced < _traced_attention_bytes(shape, [1])


def test_a_full_attention_layer_of_a_gated_delta_net_model_is_not_traced_as_one():
    """Layers marked 0 are Core's softmax attention, which saves other tensors than the delta rule."""
    shape = _tiny_shape(tp=1)
    assert _traced_attention_bytes(shape, [0]) != _traced_attention_bytes(shape, [1])


def _provider(**fields):
    base = dict(num_layers=8, num_moe_experts=4, moe_layer_freq=1, hybrid_layer_pattern=None,
                hybrid_override_pattern=None, multi_latent_attention=False, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, **GDN_FIELDS)
    return SimpleNamespace(**(base | fields))


@pytest.mark.parametrize("freq, linear", [(4, [1, 1, 1, 0, 1, 1, 1, 0]), ([1, 0] * 4, [1, 0] * 4)])
def test_layer_kinds_pair_the_moe_pattern_with_cores_linear_attention_pattern(freq, linear):
    """An int N makes every N-th layer full attention (Core's get_linear_attention_pattern), a list marks each."""
    from megatron_bridge_ext.estimate.build import is_moe_kind, layer_kinds

    kinds = layer_kinds(_provider(linear_attention_freq=freq, moe_layer_freq=[1, 0] * 4))
    assert kinds == list(zip([1, 0] * 4, linear))
    assert [is_moe_kind(kind) for kind in kinds] == [True, False] * 4


def test_set_layer_kinds_gives_core_both_patterns():
    from megatron_bridge_ext.estimate.build import layer_kinds, set_layer_kinds

    provider = _provider(linear_attention_freq=4, pipeline_model_parallel_size=2)
    set_layer_kinds(provider, [(1, 1), (1, 0), (1, 1)])
    assert provider.linear_attention_freq == [1, 0, 1] * 2 and provider.moe_layer_freq == [1] * 6
    assert layer_kinds(provider) == [(1, 1), (1, 0), (1, 1)] * 2


def test_the_reduced_trace_of_a_gated_delta_net_stage_equals_the_whole_trace(monkeypatch):
    """Eight layers, three of every four linear as in Qwen3-Next, MoE and dense mixed, traced as four: the first layer
    and one of each kind that follows (the reduced layers' kinds are not the first four layers')."""
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config
    from tests.support.estimate import assert_reduced_equals_whole

    shape = TinyGPTShape(tp=1, layers=8, hidden=H, heads=4, kv_heads=2, seq=SEQ, micro_batch=1, dtype="float32",
                         swiglu=True, experts=4, topk=2, moe_layer_freq=[1, 0, 0, 1, 1, 0, 0, 1])
    cfg = tiny_config(shape, None, linear_attention_freq=[1, 1, 1, 0, 1, 1, 1, 0], **GDN_FIELDS)
    assert_reduced_equals_whole(copy.deepcopy(cfg), monkeypatch)


def test_a_tp_that_does_not_divide_the_linear_heads_is_a_layout_problem():
    """TP 4 splits the 4 value heads but not the 2 key heads, which Core's config refuses (transformer_config.py
    L1374-1382)."""
    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    cfg = tiny_config(_tiny_shape(tp=2), None, linear_attention_freq=[1], **GDN_FIELDS)
    cfg.model.tensor_model_parallel_size = 4
    problems = memory.parallel_problems(cfg.model, micro_batch=1)
    assert [p.message for p in problems] == [
        "TP x CP = 4 does not divide the 2 gated-delta-net key heads (model.linear_num_key_heads)"]


def _backward_tensors(*, tp: int, seq: int, batch: int, element: int) -> dict[str, int]:
    """The delta rule backward's tensors alive at its return (chunk.py L105-216 at v0.4.2), name -> bytes."""
    heads, chunks = VALUE_HEADS // tp, batch * -(-seq // 64)
    tokens = batch * seq
    key, value, states = tokens * heads * KEY_DIM, tokens * heads * VALUE_DIM, chunks * heads * KEY_DIM * VALUE_DIM
    shapes = dict(w=key, dq=key, dk=key, dw=key, dk2=key, do=value, u=value, v_new=value, dv2=value, dv=value,
                  h=states, dh=states, db=tokens * heads)
    out = {name: elements * element for name, elements in shapes.items()}
    out.update({name: tokens * heads * 4 for name in ("dg", "dg2", "dg_cumsum")})
    return out


@pytest.mark.parametrize("tp, seq, batch", [(1, 32, 2), (2, 200, 1), (4, 4096, 2)])
def test_the_delta_rule_backward_transient_is_the_sum_of_its_allocations(tp, seq, batch):
    provider = SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=1, **GDN_FIELDS)
    expected = sum(_backward_tensors(tp=tp, seq=seq, batch=batch, element=2).values())
    assert gdn.backward_bytes(provider, seq=seq, micro_batch=batch, element=2) == expected


def test_the_estimate_prices_a_layer_backward_with_the_delta_rule_when_it_is_the_largest():
    """The tiny model's MLP gradients, [s, b, 2 ffn + ffn + h] x 4 B, are smaller than the delta rule's backward."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    shape = _tiny_shape(tp=1)
    est = estimate(tiny_config(shape, None, linear_attention_freq=[1], **GDN_FIELDS), attention="fused",
                   transformer_impl="local", device="cpu")
    (layer,) = [c for c in est.components if c.name.startswith("layer backward")]
    mlp = SEQ * shape.micro_batch * (3 * shape.ffn + H) * E
    delta_rule = sum(_backward_tensors(tp=1, seq=SEQ, batch=shape.micro_batch, element=E).values())
    assert delta_rule > mlp and layer.bytes == delta_rule and "gated delta rule" in layer.basis
