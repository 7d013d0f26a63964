"""FP8 on the routed experts (TE v2.17.1 ``module/grouped_linear.py``) against hand computation from the cited lines.

The tiny MoE model: 4 layers, each an MoE layer of 2 experts, top-2 (every token to every expert), h 64, expert FFN 64
(GeLU, no gated unit), 4 heads of 16 (2 query groups), TP 1, sequence 40, micro-batch 1, bf16. Under Bridge's current
scaling recipe layers 1 and 2 run in FP8 (the first and the last in bf16); under MXFP8 all four. The stage is traced
with two layers and extended to four (``memory.traced_layers``). Each expert receives 40 tokens, padded by Core for
FP8 to a multiple of ``get_fp8_align_size``: 48 rows (16) under current scaling, 64 (32) under MXFP8.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate.features import fp8_experts
from megatron_bridge_ext.estimate.trace import EXPERTS

pytestmark = [pytest.mark.unit]

LAYERS, E, H, FFN, TOKENS, BF16 = 4, 2, 64, 64, 40, 2
QKV, PROJ = ((4 + 2 * 2) * 16, H), (H, 4 * 16)
FC1, FC2 = (FFN, H), (H, FFN)  # each expert's weights [out, in]
RECIPES = {"tensorwise": ("bf16_with_fp8_current_scaling_mixed", [1, 2]),
           "mxfp8": ("bf16_with_mxfp8_mixed", [0, 1, 2, 3])}


def _ceil(a, b):
    return -(-a // b)


def _rows(recipe):
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    align = get_fp8_align_size(Fp8Recipe(recipe))
    return _ceil(TOKENS, align) * align


def _input(rows, cols, recipe):
    """One quantised input kept columnwise: 1 B per element; an fp32 scale (float8_tensor.py L92-126), or MXFP8's
    E8M0 scales [round_up(rows / 32, 4), round_up(cols, 128)] (mxfp8_tensor.py L115-118)."""
    if recipe == "mxfp8":
        return rows * cols + _ceil(rows // 32, 4) * 4 * _ceil(cols, 128) * 128
    return rows * cols + 4


def _weight(shape, recipe):
    """One quantised weight, rowwise and columnwise (precision.py's layouts): data twice, then the scales."""
    rows, cols = shape
    if recipe == "mxfp8":
        return 2 * rows * cols + _ceil(rows, 128) * 128 * _ceil(cols // 32, 4) * 4 + _ceil(rows // 32, 4) * 4 * _ceil(
            cols, 128) * 128
    return 2 * rows * cols + 4


_CACHE = {}


def _estimate(recipe):
    if recipe not in _CACHE:
        from megatron_bridge_ext.estimate import estimate
        from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

        shape = TinyGPTShape(layers=LAYERS, tp=1, sequence_parallel=False, experts=E, topk=2, seq=TOKENS,
                             micro_batch=1, dtype="bfloat16")
        cfg = tiny_config(shape, moe_grouped_gemm=True)  # imports Bridge's PEFT without Transformer Engine first
        from megatron.bridge.training import mixed_precision

        cfg.mixed_precision = getattr(mixed_precision, RECIPES[recipe][0])()
        _CACHE[recipe] = estimate(cfg, data_parallel_size=1, num_microbatches=1, attention="local",
                                  transformer_impl="local", device="cpu")
    return _CACHE[recipe]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_traced_local_experts_keep_their_padded_bf16_inputs(recipe):
    """What the contract takes off is there: per expert and layer the local spec keeps fc1's input [rows, h], its
    output [rows, ffn], GeLU's output and fc2's input [rows, ffn] and the probabilities [rows], on the padded rows."""
    rows = _rows(recipe)
    assert _estimate(recipe).activations_per_microbatch[EXPERTS] == LAYERS * E * rows * (H + 3 * FFN + 1) * BF16


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_experts_keep_columnwise_quantised_inputs_in_place_of_the_bf16_ones(recipe):
    est = _estimate(recipe)
    rows, fp8_layers = _rows(recipe), len(RECIPES[recipe][1])
    per_expert = _input(rows, H, recipe) + _input(rows, FFN, recipe) - rows * (H + FFN) * BF16
    traced = est.activations_per_microbatch[EXPERTS]
    assert est.component(EXPERTS).bytes - traced == fp8_layers * E * per_expert


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_weights_count_each_local_expert_of_the_fp8_layers_by_global_number(recipe):
    """Four real layers traced as two: the FP8 ones by their global numbers, each with the dense attention linears and
    one fc1 and fc2 weight per local expert; the bf16 layers' expert weights stay on the 16-bit experts line."""
    est = _estimate(recipe)
    fp8_layers = len(RECIPES[recipe][1])
    per_layer = _weight(QKV, recipe) + _weight(PROJ, recipe) + E * (_weight(FC1, recipe) + _weight(FC2, recipe))
    assert est.component("weights: FP8 linear weights").bytes == fp8_layers * per_layer
    assert est.component("weights: experts").bytes == (LAYERS - fp8_layers) * E * 2 * FFN * H * BF16


def test_fp8_on_shared_experts_and_latent_moe_is_refused_by_name():
    model = SimpleNamespace(fp8="hybrid", num_moe_experts=8)
    assert fp8_experts.findings(model) == []
    shared = SimpleNamespace(fp8="hybrid", num_moe_experts=8, moe_shared_expert_intermediate_size=64)
    assert ["shared experts" in f.message for f in fp8_experts.findings(shared)] == [True]
    latent = SimpleNamespace(fp8="hybrid", num_moe_experts=8, moe_latent_size=16)
    assert ["latent MoE" in f.message for f in fp8_experts.findings(latent)] == [True]
    assert fp8_experts.findings(SimpleNamespace(fp8=None, num_moe_experts=8, moe_latent_size=16)) == []


def test_the_reduced_trace_of_an_fp8_moe_stage_equals_the_whole_trace(monkeypatch):
    """Four MoE layers traced as two under FP8 current scaling: the same weights, contract and peaks as all four."""
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config
    from tests.support.estimate import assert_reduced_equals_whole

    shape = TinyGPTShape(layers=LAYERS, tp=1, sequence_parallel=False, experts=E, topk=2, seq=TOKENS, micro_batch=1,
                         dtype="bfloat16")
    cfg = tiny_config(shape, moe_grouped_gemm=True)
    from megatron.bridge.training import mixed_precision

    cfg.mixed_precision = mixed_precision.bf16_with_fp8_current_scaling_mixed()
    assert_reduced_equals_whole(cfg, monkeypatch)
