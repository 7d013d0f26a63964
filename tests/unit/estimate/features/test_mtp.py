"""Multi-token prediction in the estimate: Core's MTP block traced on the last stage, equal to the saved-tensor meter on
Core's real block of the tiny model on CPU, each depth's saves and parameters from the shapes, and the variants
refused by name.

The tiny model: 2 layers, h 64, 4 heads (2 query groups), FFN 128, vocabulary 128, sequence 32, micro-batch 2;
Core's local spec (LayerNorm, which keeps its input and an fp32 mean and rstd per token)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate.features import mtp
from megatron_bridge_ext.estimate.trace import MTP

pytestmark = [pytest.mark.unit]


def _shape(**fields):
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

    fields.setdefault("tp", 1)
    fields.setdefault("sequence_parallel", fields["tp"] > 1)
    return TinyGPTShape(**fields)


def _estimate(shape, **overrides):
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    return estimate(tiny_config(shape, **overrides), attention="local", transformer_impl="local", device="cpu")


def _measured(shape, **overrides) -> dict:
    """One forward of Core's real tiny GPTModel with its real MTP block (local backend) on CPU tensors, in a one-rank
    world, under the saved-tensor meter classified as the estimate classifies (full recompute's checkpoints counted by
    their layer, :func:`~megatron_bridge_ext.estimate.trace.checkpoints_by_layer`); backward runs afterwards."""
    import contextlib

    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.estimate.trace import checkpoints_by_layer, classifier, moe_layers_of, split
    from megatron_bridge_ext.measure import SavedActivationMeter
    from megatron_bridge_ext.testing import tiny_model

    with fake_parallel_world(tp=1, pp=1, cp=1, rank=0, device="cpu"):
        model = tiny_model.build_gpt(shape, **overrides)
        assert len(model.mtp.layers) == shape.mtp
        batch = {name: tensor.contiguous() for name, tensor in tiny_model.synthetic_batch(shape).items()}
        full = overrides.get("recompute_granularity") == "full"
        with SavedActivationMeter(model, classifier=classifier(moe_layers_of(model))) as meter, \
                (checkpoints_by_layer(meter) if full else contextlib.nullcontext()):
            loss = tiny_model.loss_of(model, batch)
        loss.backward()
    result = meter.result()
    by_category, by_layer = split(result)
    return {"total": result.total_bytes, "by_category": by_category, "by_layer": by_layer}


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.parametrize("fields, overrides", [
    (dict(mtp=2), {}),
    (dict(mtp=1, experts=2, topk=2, swiglu=True, dtype="bfloat16"), {}),
    (dict(mtp=1, swiglu=True), FULL),
], ids=["dense-2-depths", "moe-bf16", "full-recompute"])
def test_traced_bytes_equal_the_meter_on_cores_real_mtp_block(fields, overrides):
    """Every token to every expert (top-k = experts) makes the real router's load the balanced one the estimate
    states; full recompute checkpoints each MTP depth too (multi_token_prediction.py L1286-1447)."""
    from megatron_bridge_ext.estimate.device import saved_per_microbatch

    shape = _shape(**fields)
    real = _measured(shape, **overrides)
    est = _estimate(shape, **overrides)
    assert real["by_category"][MTP] > 0
    assert est.activations_per_microbatch == real["by_category"]
    assert est.activations_per_layer == real["by_layer"]
    assert saved_per_microbatch(est) == real["total"]


@pytest.mark.parametrize("tp", [1, 2])
def test_each_depth_saves_a_decoder_layer_its_three_norms_and_the_projection_input(tp):
    """A depth keeps what a decoder layer of the same spec keeps, and: enorm, hnorm and the final norm each their
    input [T, h] and fp32 mean and rstd [T]; eh_proj its input, the [T, 2h] concatenation (T = s/t x b tokens: under
    sequence parallelism the shard, which Core's column-parallel linear gathers again in backward). Under sequence
    parallelism Core gathers eh_proj's output over TP and scatters it back (multi_token_prediction.py L1143-1152) as
    a slice of the gathered [s, b, h] (mappings.py L79), which the layer's first norm keeps alive: (s - s/t) x b x h
    more than a decoder layer's shard."""
    shape = _shape(tp=tp, mtp=2)
    tokens, h, e = shape.seq // tp * shape.micro_batch, shape.hidden, 4
    est = _estimate(shape)
    gathered = (shape.seq - shape.seq // tp) * shape.micro_batch * h * e
    per_depth = est.activations_per_layer[1] + 3 * (tokens * h * e + 2 * tokens * 4) + tokens * 2 * h * e + gathered
    assert est.activations_per_microbatch[MTP] == shape.mtp * per_depth


def test_depths_add_parameters_and_the_last_stage_holds_an_embedding():
    """Each depth: enorm, hnorm and the final norm (LayerNorm: weight and bias of h), eh_proj [h, 2h] / TP, and a
    transformer layer of the decoder's; at PP 2 the last stage also builds the word embedding (vocab / TP x h) that
    the depths embed their shifted tokens with (gpt_model.py L167)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.estimate.build import FUSED, build_rank_model
    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    shape = _shape(tp=2, mtp=2, layers=2)
    cfg = tiny_config(shape, pipeline_model_parallel_size=2)
    prepared = memory.prepare(cfg, data_parallel_size=1, num_microbatches=2)
    with fake_parallel_world(tp=2, pp=2, cp=1, rank=2, device="cpu"):  # TP rank 0 of the last stage
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        model = build_rank_model(copy.deepcopy(prepared.provider), None, attention=FUSED, mode=mode, device="cpu",
                                 dtype=torch.float32, transformer_impl="local")
    h = shape.hidden
    layer = sum(p.numel() for p in model.decoder.layers[0].parameters())
    assert sum(p.numel() for p in model.mtp.parameters()) == shape.mtp * (3 * 2 * h + 2 * h * h // 2 + layer)
    assert model.embedding.word_embeddings.weight.numel() == shape.vocab // 2 * h


def test_the_trace_leaves_cores_mtp_metrics_tracker_as_it_found_it():
    """``process_mtp_loss`` adds each depth's loss to a class-global tracker sized by the first model that recorded
    (multi_token_prediction.py L373-378): a trace with 2 depths after one with 1 must not find it, nor leave its own."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    before = MTPLossLoggingHelper.tracker
    one = _estimate(_shape(mtp=1)).activations_per_microbatch[MTP]
    two = _estimate(_shape(mtp=2)).activations_per_microbatch[MTP]
    assert two == 2 * one
    assert MTPLossLoggingHelper.tracker is before


def test_a_model_without_mtp_saves_nothing_as_mtp_and_is_not_described():
    est = _estimate(_shape())
    assert est.activations_per_microbatch[MTP] == 0
    assert not any("multi-token prediction" in line for line in est.assumptions)
    assert mtp.assumption(SimpleNamespace(mtp_num_layers=None)) is None


def test_the_variants_not_modelled_are_refused_by_name():
    """MTP on a stage before the loss's (Core's standalone MTP) and FP8 are refused; MTP a layout puts on the last
    stage is traced there."""
    model = SimpleNamespace(mtp_num_layers=1, pipeline_model_parallel_layout="Et|tm|L", pipeline_model_parallel_size=3,
                            fp8="hybrid")
    assert [f.setting for f in mtp.findings(model)] == ["model.pipeline_model_parallel_layout", "model.mtp_num_layers"]
    last = SimpleNamespace(mtp_num_layers=1, pipeline_model_parallel_layout="Et|t|tmL", pipeline_model_parallel_size=3,
                           fp8=None)
    assert mtp.findings(last) == []
    assert mtp.findings(SimpleNamespace(mtp_num_layers=2, pipeline_model_parallel_layout=None, fp8=None)) == []
    assert mtp.findings(SimpleNamespace(mtp_num_layers=None, pipeline_model_parallel_layout="x", fp8="hybrid")) == []


@pytest.mark.parametrize("depth", ["*-", "*E"])
def test_a_hybrid_models_depth_saves_its_patterns_layers_its_norms_and_the_projection_input(depth):
    """Nemotron 3 Nano's config shrunk (RMSNorm: its input and an fp32 rstd per token), TP 2 with SP, pattern MEM*-
    and one MTP depth of pattern ``depth`` (``mtp_hybrid_override_pattern``, which Bridge appends after ``/``): the
    depth's attention, MLP or MoE layer saves what the decoder's layer of that kind saves (layers 3, 4 and 1), and
    the depth adds its three norms, eh_proj's [T, 2h] input and the gathered hidden state its first norm keeps."""
    from megatron_bridge_ext.estimate import memory
    from tests.unit.estimate.test_estimate_hybrid import _tiny

    cfg = _tiny(pattern="MEM*-", extra=("model.mtp_num_layers=1", f"model.mtp_hybrid_override_pattern={depth}"))
    est = memory.estimate(cfg)
    seq, tp, h, e = cfg.model.seq_length, 2, cfg.model.hidden_size, 2
    tokens = seq // tp * est.settings.micro_batch
    layers = est.activations_per_layer
    own = {"*": layers[3], "-": layers[4], "E": layers[1]}
    depth_layers = sum(own[kind] for kind in depth)
    norms = 3 * (tokens * h * e + tokens * 4)
    gathered = (seq - seq // tp) * est.settings.micro_batch * h * e
    assert est.activations_per_microbatch[MTP] == depth_layers + norms + tokens * 2 * h * e + gathered
