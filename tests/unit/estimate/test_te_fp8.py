"""The FP8 activation contract (TE v2.8) against hand computation from the cited lines and the tiny model's shapes.

Tiny model (``test_precision.SHAPE``): seq 64, micro-batch 1, hidden 64, 4 heads of 16 (2 query groups), FFN 128
(no gated unit), TP 2 with sequence parallelism. Per layer on TP rank 0 the GEMM inputs are:
``linear_qkv`` / ``linear_fc1``: the norm-output shard [64 / 2, 1, 64] = 32 x 64; ``linear_proj``: the attention
output [64, 1, 4 * 16 / 2] = 64 x 32; ``linear_fc2``: [64, 1, 128 / 2] = 64 x 64. The local spec saves each in bf16
(2 B), the first three alone, ``linear_proj``'s shared with the attention stand-in that keeps its output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate import precision, te_fp8
from tests.unit.estimate.test_precision import _estimate, _tiny

pytestmark = [pytest.mark.unit]

QKV = FC1 = (32, 64)
PROJ = (64, 32)
FC2 = (64, 64)
BF16 = 2


def _n(shape):
    return shape[0] * shape[1]


# Float8 (tensorwise, delayed): 1 B per element + one fp32 scale (float8_tensor.py L92-126), either usage.
def _float8(shape):
    return _n(shape) + 4


# MXFP8 columnwise (mxfp8_tensor.py L115-118): scales [round_up(rows / 32, 4), round_up(cols, 128)].
def _mx_col(shape):
    rows, cols = shape
    return _n(shape) + 4 * (-(-rows // 32 // 4)) * 128 * (-(-cols // 128))


# MXFP8 rowwise (L103-106): scales [round_up(rows, 128), round_up(cols / 32, 4)].
def _mx_row(shape):
    rows, cols = shape
    return _n(shape) + 128 * (-(-rows // 128)) * 4 * (-(-cols // 32 // 4))


@pytest.mark.parametrize("rows, cols, recipe, usage, expected", [
    (32, 64, "tensorwise", "rowwise", 32 * 64 + 4),
    (32, 64, "delayed", "columnwise", 32 * 64 + 4),
    (32, 64, "mxfp8", "rowwise", 32 * 64 + 128 * 4),  # 32 rows padded to 128, 2 scales a row padded to 4
    (32, 64, "mxfp8", "columnwise", 32 * 64 + 4 * 128),  # 1 scale row padded to 4, 64 columns padded to 128
    (256, 512, "mxfp8", "columnwise", 256 * 512 + 8 * 512),
])
def test_quantised_activation_bytes_per_layout(rows, cols, recipe, usage, expected):
    assert te_fp8.activation_bytes(rows, cols, recipe, usage) == expected


def test_blockwise_activations_are_refused_by_name():
    fp8 = precision.Fp8(recipe="blockwise", fp8_format="hybrid", params=False, bf16_at_start=0, bf16_at_end=0,
                        num_layers=2, weight_cache=True)
    assert te_fp8.refused(fp8)
    assert te_fp8.contract(SimpleNamespace(linear_saved={}, linear_alone={}, lora_a_saved={}), fp8,
                           te_fp8.Shapes(64, 1, 64, 32, 64, 2, True), lambda layer: True) is None
    assert "not modelled for blockwise scaling" in precision.activation_note(fp8)
    with pytest.raises(ValueError):
        te_fp8.activation_bytes(32, 64, "blockwise", "rowwise")


@pytest.mark.parametrize("linear, recipe, sp, usage", [
    ("linear_qkv", "tensorwise", True, "rowwise"),  # Float8 gathers rowwise only (L186-193), keeps it (L405-414)
    ("linear_qkv", "tensorwise", False, "columnwise"),  # no gather: rowwise dropped (L405-414)
    ("linear_fc1", "mxfp8", True, "columnwise"),  # MXFP8 gathers columnwise data: rowwise dropped
    ("linear_fc2", "delayed", True, "columnwise"),  # Linear, row-parallel: linear.py L371-385
])
def test_the_saved_usage_follows_the_gather_and_the_recipe(linear, recipe, sp, usage):
    fp8 = precision.Fp8(recipe=recipe, fp8_format="hybrid", params=True, bf16_at_start=0, bf16_at_end=0,
                        num_layers=2, weight_cache=True)
    assert te_fp8.saved_usage(linear, fp8, sp) == usage


def test_a_shared_input_gets_its_quantised_copy_on_top_and_a_lone_one_is_replaced():
    """Delayed scaling: linear_proj's input, kept by attention too, stays and its quantised copy comes on top;
    linear_fc2's, kept by it alone, is replaced. A layer not in FP8 is left as traced."""
    traced = SimpleNamespace(
        linear_saved={"decoder.layers.0.self_attention.linear_proj": _n(PROJ) * BF16,
                      "decoder.layers.0.mlp.linear_fc2": _n(FC2) * BF16,
                      "decoder.layers.1.mlp.linear_fc2": _n(FC2) * BF16},
        linear_alone={"decoder.layers.0.mlp.linear_fc2": _n(FC2) * BF16,
                      "decoder.layers.1.mlp.linear_fc2": _n(FC2) * BF16},
        lora_a_saved={})
    fp8 = precision.Fp8(recipe="delayed", fp8_format="hybrid", params=True, bf16_at_start=0, bf16_at_end=1,
                        num_layers=2, weight_cache=True)
    acts = te_fp8.contract(traced, fp8, te_fp8.Shapes(64, 1, 64, 32, 64, 2, True), lambda layer: layer == 0)
    assert acts.added == {"attention": _float8(PROJ), "mlp": _float8(FC2)}
    assert acts.removed == {"attention": 0, "mlp": _n(FC2) * BF16}
    assert acts.converted == 2 and acts.kept_bf16 == 0


@pytest.fixture(scope="module")
def bf16():
    return _estimate(_tiny("bf16_mixed"))


def _activations(est):
    return {c.name: c.bytes for c in est.components if c.kind == "activations"}


# Per FP8 layer and microbatch, the change to each category: TE's quantised input in, the lone bf16 input out.
FLOAT8_MLP = _float8(FC1) - _n(FC1) * BF16 + _float8(FC2) - _n(FC2) * BF16
CURRENT_ATTENTION = _float8(QKV) - _n(QKV) * BF16  # linear_proj keeps its bf16 input (save_original_input)
DELAYED_ATTENTION = CURRENT_ATTENTION + _float8(PROJ)  # its quantised copy on top of attention's bf16 output
MXFP8_ATTENTION = _mx_col(QKV) - _n(QKV) * BF16
MXFP8_MLP = _mx_col(FC1) - _n(FC1) * BF16 + _mx_col(FC2) - _n(FC2) * BF16


@pytest.mark.parametrize("recipe_name, fp8_layers, attention, mlp", [
    ("bf16_with_fp8_current_scaling_mixed", 1, CURRENT_ATTENTION, FLOAT8_MLP),  # layers 1 and 3 kept in bf16
    ("bf16_with_fp8_delayed_scaling_mixed", 3, DELAYED_ATTENTION, FLOAT8_MLP),
    ("bf16_with_mxfp8_mixed", 3, MXFP8_ATTENTION, MXFP8_MLP),
])
def test_the_fp8_layers_linear_inputs_are_counted_as_te_keeps_them(bf16, recipe_name, fp8_layers, attention, mlp):
    est = _estimate(_tiny(recipe_name))
    got, want = _activations(est), _activations(bf16)
    assert got["attention"] == want["attention"] + fp8_layers * attention
    assert got["mlp"] == want["mlp"] + fp8_layers * mlp
    for name in ("norms", "embedding", "logits and loss"):
        assert got[name] == want[name], name
    assert est.activations_per_microbatch == bf16.activations_per_microbatch  # the trace itself is bf16
    [line] = [a for a in est.assumptions if a.startswith("FP8 activations by Transformer Engine's contract")]
    assert f"{fp8_layers * (4 if 'delayed' in recipe_name else 3)} trainable linear input(s)" in line


def test_delayed_and_current_scaling_differ_by_linear_projs_quantised_copy():
    """All 3 layers in FP8 either way (Core refuses bf16 layers with delayed scaling)."""
    delayed = _activations(_estimate(_tiny("bf16_with_fp8_delayed_scaling_mixed")))
    current = _activations(_estimate(_tiny("bf16_with_fp8_current_scaling_mixed", first_last_layers_bf16=False)))
    assert delayed["attention"] - current["attention"] == 3 * _float8(PROJ)
    assert delayed["mlp"] == current["mlp"]


def test_layernorm_recompute_leaves_the_norm_linears_inputs_as_traced_and_says_so():
    """Only linear_fc2's input is converted; linear_qkv's and linear_fc1's (and the LoRA shards of those layers)
    stay as traced, named among the assumptions. (Core refuses the config without TE >= 2.6, so it is checked on
    the contract itself.)"""
    traced = SimpleNamespace(
        linear_saved={"decoder.layers.0.self_attention.linear_qkv": _n(QKV) * BF16,
                      "decoder.layers.0.mlp.linear_fc1": _n(FC1) * BF16,
                      "decoder.layers.0.mlp.linear_fc2": _n(FC2) * BF16},
        linear_alone={"decoder.layers.0.self_attention.linear_qkv": _n(QKV) * BF16,
                      "decoder.layers.0.mlp.linear_fc1": _n(FC1) * BF16,
                      "decoder.layers.0.mlp.linear_fc2": _n(FC2) * BF16},
        lora_a_saved={})
    fp8 = precision.Fp8(recipe="tensorwise", fp8_format="hybrid", params=True, bf16_at_start=0, bf16_at_end=0,
                        num_layers=1, weight_cache=True)
    acts = te_fp8.contract(traced, fp8, te_fp8.Shapes(64, 1, 64, 32, 64, 2, True), lambda layer: True,
                           norm_linears=False)
    assert acts.added == {"mlp": _float8(FC2)} and acts.removed == {"mlp": _n(FC2) * BF16}
    assert any(a.startswith("FP8 activations with selective layernorm recompute") for a in te_fp8.assumptions(acts))


def _lora(recipe_name, strategy=None):
    from megatron_bridge_ext.peft import LoRA

    cfg = _tiny(recipe_name)
    cfg.peft = LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], dim=8, alpha=16,
                    sequence_parallel_input_strategy=strategy)
    return cfg


@pytest.mark.parametrize("recipe_name, fp8_layers, shard", [
    ("bf16_with_fp8_current_scaling_mixed", 1, _float8(QKV)),
    ("bf16_with_mxfp8_mixed", 3, _mx_row(QKV)),  # rowwise: backward_needs_input is False (L186-193)
])
def test_lora_keeps_a_quantised_norm_output_shard_per_adapted_norm_linear_and_its_frozen_bases_keep_none(
        recipe_name, fp8_layers, shard):
    """A frozen base saves no input (linear.py L135, L388-390; layernorm_linear.py L164), as the local spec's;
    each adapted LayerNormLinear (linear_qkv, linear_fc1) keeps the quantised copy of its norm-output shard."""
    bf16_lora = _activations(_estimate(_lora("bf16_mixed")))
    got = _activations(_estimate(_lora(recipe_name)))
    assert got.pop("TE FP8 norm-output shards (contract)") == fp8_layers * 2 * shard
    assert got == bf16_lora


def test_under_transformer_engine_an_fp8_layers_shard_is_quantised_and_a_bf16_layers_stays_bf16():
    """Current scaling keeps layers 1 and 3 in bf16: their adapted linear_qkv and linear_fc1 keep the bf16 shard
    of :mod:`.te` (Bridge's gathered path), layer 2's the quantised one."""
    from megatron_bridge_ext.estimate import estimate

    est = estimate(_lora("bf16_with_fp8_current_scaling_mixed"), data_parallel_size=1, num_microbatches=1,
                   transformer_impl="transformer_engine")
    got = _activations(est)
    assert got["TE norm-output shards (contract)"] == 2 * 2 * _n(QKV) * BF16
    assert got["TE FP8 norm-output shards (contract)"] == 2 * _float8(QKV)


@pytest.mark.parametrize("strategy", ["regather", "shard_local"])
def test_our_lora_a_keeps_the_bf16_shard_and_te_its_quantised_copy_beside_it(strategy):
    """Our LoRA-A takes TE's non-gathered norm output, the bf16 shard TE returns (layernorm_linear.py L223-225):
    in a bf16 layer the same storage as TE's (nothing added), in an FP8 layer TE keeps its quantised copy
    (L250-251): one per adapted linear_qkv / linear_fc1 of the one FP8 layer (current scaling)."""
    from megatron_bridge_ext.estimate import estimate

    def run(recipe_name):
        return _activations(estimate(_lora(recipe_name, strategy), data_parallel_size=1, num_microbatches=1,
                                     transformer_impl="transformer_engine"))

    bf16, got = run("bf16_mixed"), run("bf16_with_fp8_current_scaling_mixed")
    assert "TE norm-output shards (contract)" not in bf16
    assert got.pop("TE FP8 norm-output shards (contract)") == 2 * _float8(QKV)
    assert got == bf16


def test_the_plan_names_no_fp8_activations_as_not_modelled_but_blockwise():
    from megatron_bridge_ext.estimate import unmodelled

    assert unmodelled.config_lines(_tiny("bf16_with_fp8_current_scaling_mixed")) == []
    [line] = unmodelled.config_lines(_tiny("bf16_with_fp8_subchannel_scaling_mixed"))
    assert line.startswith("activations under FP8 are not modelled for blockwise scaling")
