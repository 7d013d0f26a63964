"""FP8 in the static estimate: Bridge's mixed-precision recipes read as Megatron Core reads them, and the bytes
Transformer Engine keeps per FP8 linear weight, against hand computation from the cited TE v2.8 lines.

Hand computation, for a weight of [rows, cols] (TE quantises along the last dimension):

* tensorwise / delayed (``float8_tensor.py`` L106-126): data rows*cols + transpose cols*rows, 1 B each, and
  one fp32 scale: 2*rows*cols + 4;
* MXFP8 (``mxfp8_tensor.py`` L101-119): rowwise and columnwise data, 1 B each, rowwise scales
  round_up(rows, 128) x round_up(cols/32, 4) and columnwise scales round_up(rows/32, 4) x round_up(cols, 128),
  1 B each;
* blockwise, 128 x 128 weight blocks (``float8_blockwise_tensor.py`` L137-145, L227-247): both data layouts,
  rowwise scales ceil(rows/128) x round_up(ceil(cols/128), 4), columnwise ceil(cols/128) x
  round_up(ceil(rows/128), 4), fp32.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate import precision

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("shape, recipe, expected", [
    ((64, 64), "tensorwise", 8192 + 4),
    ((64, 64), "delayed", 8192 + 4),
    ((2560, 8192), "tensorwise", 2 * 2560 * 8192 + 4),  # Llama 3 70B linear_qkv on TP 4
    # rowwise scales 128 x 4, columnwise 4 x 128
    ((64, 64), "mxfp8", 8192 + 512 + 512),
    # rowwise scales 128 x round_up(1, 4) = 512, columnwise round_up(2, 4) x 128 = 512
    ((64, 32), "mxfp8", 4096 + 512 + 512),
    # rowwise 2560 x 256, columnwise 80 x 8192: no padding
    ((2560, 8192), "mxfp8", 2 * 2560 * 8192 + 2560 * 256 + 80 * 8192),
    # rowwise 1 x 4 fp32, columnwise 1 x 4 fp32
    ((64, 64), "blockwise", 8192 + 4 * (4 + 4)),
    # rowwise ceil(300/128)=3 x round_up(2, 4)=4 = 12, columnwise 2 x round_up(3, 4)=4 = 8
    ((300, 200), "blockwise", 120000 + 4 * (12 + 8)),
])
def test_quantised_weight_bytes_by_recipe(shape, recipe, expected):
    assert precision.quantized_bytes(shape, recipe) == expected


def test_an_unknown_recipe_is_refused_by_name():
    with pytest.raises(ValueError, match="fp8_recipe='custom'"):
        precision.quantized_bytes((64, 64), "custom")


@pytest.mark.parametrize("layers, start, end, keep", [(80, 1, 1, True), (52, 2, 2, True), (8, 1, 1, False),
                                                       (6, 0, 3, True)])
def test_fp8_layers_are_the_ones_core_does_not_keep_in_bf16(layers, start, end, keep):
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    core = SimpleNamespace(num_layers=layers, first_last_layers_bf16=keep, num_layers_at_start_in_bf16=start,
                           num_layers_at_end_in_bf16=end)
    fp8 = precision.fp8_of(SimpleNamespace(fp8="hybrid", fp8_recipe="tensorwise", fp8_param=False,
                                           disable_parameter_transpose_cache=False, **vars(core)))
    assert [fp8.layer_in_fp8(n) for n in range(layers)] == [not is_first_last_bf16_layer(core, n)
                                                             for n in range(layers)]


SHAPE = dict(layers=3, hidden=64, ffn=128, heads=4, kv_heads=2, seq=64, micro_batch=1, vocab=128, tp=2,
             dtype="bfloat16")
# Per layer on TP 2: linear_qkv [(4 + 2*2) * 16 / 2, 64] = [64, 64], linear_proj [64, 32], linear_fc1 [64, 64],
# linear_fc2 [64, 64]: 14,336 elements.
LAYER_ELEMENTS = 4096 + 2048 + 4096 + 4096
TENSORWISE_LAYER = 2 * LAYER_ELEMENTS + 4 * 4
MXFP8_LAYER = 3 * (8192 + 1024) + (4096 + 1024)
BLOCKWISE_LAYER = 3 * (8192 + 32) + (4096 + 32)


def _tiny(recipe_name=None, **fields):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    cfg = tiny_config(TinyGPTShape(**SHAPE))  # imports Bridge's PEFT without Transformer Engine first
    from megatron.bridge.training import mixed_precision

    if recipe_name:
        cfg.mixed_precision = getattr(mixed_precision, recipe_name)()
        for name, value in fields.items():
            setattr(cfg.mixed_precision, name, value)
    return cfg


@pytest.mark.parametrize("recipe_name, expected", [
    ("bf16_with_fp8_current_scaling_mixed", ("tensorwise", "hybrid", True, 1, 1)),
    ("bf16_with_fp8_delayed_scaling_mixed", ("delayed", "hybrid", True, 0, 0)),
    ("bf16_with_mxfp8_mixed", ("mxfp8", "e4m3", True, 0, 0)),
    ("bf16_with_fp8_subchannel_scaling_mixed", ("blockwise", "hybrid", False, 0, 0)),
])
def test_bridges_recipes_are_read_from_the_config(recipe_name, expected):
    fp8 = precision.fp8_of_config(_tiny(recipe_name))
    assert (fp8.recipe, fp8.fp8_format, fp8.params, fp8.bf16_at_start, fp8.bf16_at_end) == expected
    assert fp8.num_layers == SHAPE["layers"] and fp8.weight_cache


def test_bf16_has_no_fp8_settings():
    assert precision.fp8_of_config(_tiny("bf16_mixed")) is None


class _Layer(torch.nn.Module):
    def __init__(self, number: int, hidden: int):
        super().__init__()
        self.layer_number = number
        self.self_attention = torch.nn.Module()
        self.mlp = torch.nn.Module()
        for parent, name, shape in ((self.self_attention, "linear_qkv", (3 * hidden, hidden)),
                                    (self.self_attention, "linear_proj", (hidden, hidden)),
                                    (self.mlp, "linear_fc1", (4 * hidden, hidden)),
                                    (self.mlp, "linear_fc2", (hidden, 4 * hidden))):
            linear = torch.nn.Module()
            linear.weight = torch.nn.Parameter(torch.empty(shape, device="meta"))
            setattr(parent, name, linear)


def test_a_later_pipeline_stage_is_read_by_its_global_layer_numbers():
    """Stage 1 of PP 2 over 4 layers holds layers 3 and 4 (1-based): with the last layer in bf16, only layer 3."""
    model = SimpleNamespace(decoder=SimpleNamespace(layers=[_Layer(3, 32), _Layer(4, 32)]))
    fp8 = precision.Fp8(recipe="tensorwise", fp8_format="hybrid", params=True, bf16_at_start=1, bf16_at_end=1,
                        num_layers=4, weight_cache=True)
    weights = precision.fp8_weights(model, fp8)
    assert weights.layers == 1
    assert weights.elements == 3 * 32 * 32 + 32 * 32 + 4 * 32 * 32 + 4 * 32 * 32
    assert weights.quantized == 2 * weights.elements + 4 * 4


def _estimate(cfg):
    from megatron_bridge_ext.estimate import estimate

    return estimate(cfg, data_parallel_size=1, num_microbatches=1)


def _bytes(est, name):
    return est.component(name).bytes


@pytest.fixture(scope="module")
def bf16():
    return _estimate(_tiny("bf16_mixed"))


@pytest.mark.parametrize("recipe_name, fields, fp8_layers, per_layer", [
    ("bf16_with_fp8_current_scaling_mixed", {}, 1, TENSORWISE_LAYER),  # layers 1 and 3 kept in bf16
    ("bf16_with_fp8_delayed_scaling_mixed", {}, 3, TENSORWISE_LAYER),
    ("bf16_with_mxfp8_mixed", {}, 3, MXFP8_LAYER),
])
def test_fp8_parameters_are_stored_quantised_in_place_of_their_16_bit_weights(bf16, recipe_name, fields, fp8_layers,
                                                                              per_layer):
    est = _estimate(_tiny(recipe_name, **fields))
    assert _bytes(est, "weights: FP8 linear weights") == fp8_layers * per_layer
    assert _bytes(est, "weights: transformer layers") == (_bytes(bf16, "weights: transformer layers")
                                                          - fp8_layers * LAYER_ELEMENTS * 2)
    for name in ("gradients (main_grad buffer)", "optimizer states", "weights: embedding", "weights: output layer"):
        assert _bytes(est, name) == _bytes(bf16, name), name  # fp32 main_grad and main copy as for bf16
    with pytest.raises(KeyError):
        est.component("FP8 weight copies (TE workspaces)")


@pytest.mark.parametrize("recipe_name, fields, fp8_layers, per_layer", [
    ("bf16_with_fp8_current_scaling_mixed", {"fp8_param_gather": False}, 1, TENSORWISE_LAYER),
    ("bf16_with_fp8_subchannel_scaling_mixed", {}, 3, BLOCKWISE_LAYER),
])
def test_16_bit_parameters_get_te_cached_quantised_copies(bf16, recipe_name, fields, fp8_layers, per_layer):
    est = _estimate(_tiny(recipe_name, **fields))
    assert _bytes(est, "FP8 weight copies (TE workspaces)") == fp8_layers * per_layer
    assert _bytes(est, "weights: transformer layers") == _bytes(bf16, "weights: transformer layers")
    assert _static_bytes(est) == _static_bytes(bf16) + fp8_layers * per_layer  # activations: test_te_fp8.py


def _static_bytes(est):
    return sum(c.bytes for c in est.components if c.kind == "static")


def test_a_lora_models_frozen_base_weights_are_stored_as_fp8_and_its_adapters_stay_16_bit():
    """Bridge's LoRA wraps each base linear (``to_wrap``): its weight is what TE quantises, the same bytes as
    without LoRA; the adapters are counted apart, in 16 bits."""
    cfg = _tiny("bf16_with_fp8_current_scaling_mixed")
    from megatron_bridge_ext.peft import LoRA

    cfg.peft = LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], dim=8, alpha=16)
    est = _estimate(cfg)
    assert _bytes(est, "weights: FP8 linear weights") == TENSORWISE_LAYER
    assert _bytes(est, "weights: adapters") > 0


def test_blockwise_activations_are_named_as_not_modelled_and_shown_as_traced_in_bf16(bf16):
    est = _estimate(_tiny("bf16_with_fp8_subchannel_scaling_mixed"))
    assert [c for c in est.components if c.kind == "activations"] == [
        c for c in bf16.components if c.kind == "activations"]
    [note] = [a for a in est.assumptions if a.startswith("activations under FP8 are not modelled")]
    assert "shown as traced in bf16" in note
    assert precision.activation_note(precision.fp8_of_config(_tiny("bf16_with_fp8_subchannel_scaling_mixed"))) == note


def test_fp4_is_still_refused_by_name():
    from megatron_bridge_ext.estimate.memory import NotModelled, prepare

    cfg = _tiny()
    cfg.model.fp4 = "e2m1"
    with pytest.raises(NotModelled) as refused:
        prepare(cfg, data_parallel_size=1, num_microbatches=1)
    assert refused.value.findings[0].setting == "model.fp4"


def test_an_fp4_recipe_is_refused_before_bridge_asks_for_transformer_engine():
    """Bridge's ``MixedPrecisionConfig.finalize`` raises for FP4 where TE is not installed (as here): the estimate
    names FP4 as not modelled instead of failing on the machine it runs on."""
    from megatron_bridge_ext.estimate.memory import NotModelled, prepare

    cfg = _tiny("bf16_with_nvfp4_mixed")
    with pytest.raises(NotModelled) as refused:
        prepare(cfg, data_parallel_size=1, num_microbatches=1)
    assert refused.value.findings[0].setting == "mixed_precision"


def test_the_fp4_refusal_says_transformer_engine_runs_nvfp4_on_blackwell_only():
    """Llama 3 8B's ``..._h100_nvfp4_config`` names H100, where TE asserts compute capability 10.0 on entering the
    FP4 autocast: the refusal says so, the bf16 / FP8 fix stays."""
    from megatron_bridge_ext.estimate.memory import NotModelled, prepare

    with pytest.raises(NotModelled) as refused:
        prepare(_tiny("bf16_with_nvfp4_mixed"), data_parallel_size=1, num_microbatches=1)
    assert "compute capability 10.0" in refused.value.findings[0].message
    assert "Blackwell" in refused.value.findings[0].message


@pytest.mark.parametrize("recipe, note", [("blockwise", True), ("delayed", False), ("tensorwise", False),
                                          ("mxfp8", False)])
def test_only_blockwise_activations_are_named_as_not_modelled(recipe, note):
    """The other recipes follow TE's FP8 contract (estimate.te_fp8), which says what it models among the assumptions."""
    fp8 = precision.Fp8(recipe=recipe, fp8_format="hybrid", params=True, bf16_at_start=0, bf16_at_end=0,
                        num_layers=4, weight_cache=True)
    assert (precision.activation_note(fp8) is not None) == note
    assert any(n.startswith("activations under FP8 are not modelled") for n in precision.notes(fp8)) == note


def test_fp8_attention_is_named_as_not_modelled():
    fp8 = precision.fp8_of_config(_tiny("bf16_with_fp8_current_scaling_mixed", fp8_dot_product_attention=True))
    assert fp8.dot_product_attention
    assert any(n.startswith("fp8_dot_product_attention: attention in FP8 is not modelled") for n in precision.notes(fp8))


def test_mlp_recompute_under_fp8_traces_without_transformer_engine_and_saves_what_it_saves_in_bf16():
    """Core recomputes an FP8 layer's MLP through TE's checkpoint, which raises without TE; the trace's stand-in keeps
    the same checkpoint inputs as Core's own checkpoint does for the bf16 config (before FP8's contract)."""
    fp8 = _tiny("bf16_with_fp8_current_scaling_mixed")
    plain = _tiny("bf16_mixed")
    for cfg in (fp8, plain):
        cfg.model.recompute_granularity, cfg.model.recompute_modules = "selective", ["mlp"]
    assert _estimate(fp8).activations_per_microbatch == _estimate(plain).activations_per_microbatch


def _interleaved(keep_at_start: int):
    """8 layers over PP 2 with VPP 2 (chunks of 2 layers), the first ``keep_at_start`` layers in bf16, none at the
    end (FP8 current scaling)."""
    cfg = _tiny("bf16_with_fp8_current_scaling_mixed", num_layers_at_start_in_bf16=keep_at_start,
                num_layers_at_end_in_bf16=0)
    cfg.model.num_layers, cfg.model.pipeline_model_parallel_size = 8, 2
    cfg.model.virtual_pipeline_model_parallel_size = 2
    cfg.model.microbatch_group_size_per_vp_stage = None  # as a recipe leaves it: PP, once Core's post-init runs
    cfg.train.global_batch_size = 4 * cfg.train.micro_batch_size
    return cfg


@pytest.mark.parametrize("stage, expected", [(0, [0, 1, 4, 5]), (1, [2, 3, 6, 7])])
def test_an_interleaved_stage_numbers_its_layers_by_chunk(stage, expected):
    """Core gives chunk v of stage s the layers v x PP x 2 + s x 2 + (0, 1): stage 0 holds 0, 1 (chunk 0) and 4, 5
    (chunk 1), traced as one model of four layers."""
    from megatron_bridge_ext.estimate import memory

    prepared = memory.prepare(_interleaved(3), data_parallel_size=1, num_microbatches=4)
    model = SimpleNamespace(decoder=SimpleNamespace(layers=[_Layer(n, 32) for n in range(1, 5)]))
    assert memory.global_layer_numbers(prepared.provider, stage, model) == expected


def test_fp8_layers_of_an_interleaved_stage_are_read_by_their_global_numbers():
    """The first 3 of 8 layers in bf16: the reported stage's FP8 layers are those of its global numbers (stage 0:
    4 and 5; stage 1: 3, 6 and 7), where reading a stage's layers as contiguous would give stage 0 one (3) and
    stage 1 four."""
    from megatron_bridge_ext.estimate import estimate

    est = estimate(_interleaved(3), data_parallel_size=1, num_microbatches=4)  # Core's schedule: 4 >= group (PP)
    fp8_layers = {0: 2, 1: 3}[est.stage]
    assert f"of the {fp8_layers} FP8 layers' dense linears" in est.component("weights: FP8 linear weights").basis
    assert _bytes(est, "weights: FP8 linear weights") == fp8_layers * TENSORWISE_LAYER


def test_full_recompute_under_fp8_traces_without_transformer_engine_and_saves_what_it_saves_in_bf16():
    """Full recompute runs each chunk of layers through TE's checkpoint under FP8 (recompute.py L130-140), which
    Core's block module holds as None without TE; the trace's stand-in keeps each chunk's inputs as Core's own
    checkpoint does for the bf16 config: the chunk's [s/t, b, h] hidden state (SP on TP 2), and the rotary table
    [s, 1, 1, h / heads] in fp32 that every chunk is handed (L128), one storage for all chunks."""
    fp8 = _tiny("bf16_with_fp8_current_scaling_mixed")
    plain = _tiny("bf16_mixed")
    for cfg in (fp8, plain):
        cfg.model.recompute_granularity, cfg.model.recompute_method = "full", "uniform"
        cfg.model.recompute_num_layers, cfg.model.recompute_modules = 1, None
    kept = {name: _estimate(cfg).component("recompute checkpoints").bytes
            for name, cfg in (("fp8", fp8), ("bf16", plain))}
    seq, tp, hidden, heads = SHAPE["seq"], SHAPE["tp"], SHAPE["hidden"], SHAPE["heads"]
    chunk_inputs = SHAPE["layers"] * (seq // tp) * SHAPE["micro_batch"] * hidden * 2
    rotary = seq * (hidden // heads) * 4
    assert kept["fp8"] == kept["bf16"] == chunk_inputs + rotary
