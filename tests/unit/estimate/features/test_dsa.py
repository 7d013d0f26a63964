"""DeepSeek sparse attention in the estimate: the traced bytes of a layer equal the saved-tensor meter on Megatron
Core's real layer on CPU (its indexer, top-k, indexer loss and sparse attention), and the variants refused by name.

The tiny model: h 64, 4 heads, q_lora_rank 24, kv_lora_rank 16, qk_head_dim 16, qk_pos_emb_head_dim 8, v_head_dim 12,
an indexer of 2 heads of 16 keeping the top 8 keys, sequence 32, micro-batch 2, fp32, TP 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate.features import dsa, mla

pytestmark = [pytest.mark.unit]

INDEXER = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=16,
               dsa_indexer_topk=8, dsa_indexer_rotate_activation=False)


def _shape():
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

    return TinyGPTShape(tp=1, sequence_parallel=False, heads=4, kv_heads=4, mla=True, q_lora_rank=24, kv_lora_rank=16,
                        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, seq=32,
                        micro_batch=2, hidden=64, dtype="float32")


def _estimated(**fields) -> int:
    """What layer 1 of the tiny model saves per microbatch in the estimate's trace."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    est = estimate(tiny_config(_shape(), None, **fields), attention="fused", transformer_impl="local", device="cpu")
    return est.activations_per_layer[1]


def _measured(**fields) -> int:
    """What Core's real layer 2 (layer 1 counted from 0) saves in one forward on real CPU tensors, by the meter; its
    backward runs too. Built from Core's DSA spec as training builds it, TELinear's duplicated linears by the
    stand-in (Transformer Engine does not run here)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.measure import SavedActivationMeter
    from megatron_bridge_ext.testing.tiny_model import transformer_config

    shape = _shape()
    with fake_parallel_world(tp=1, pp=1, cp=1, rank=0, device="cpu"):
        config = transformer_config(shape, **fields)
        spec = get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm")
        spec.submodules.self_attention = dsa.attention_spec(config)
        with dsa.te_modules():
            layer = build_module(spec, config=config, layer_number=2).train()
        x = torch.randn(shape.seq, shape.micro_batch, shape.hidden, requires_grad=True)
        with SavedActivationMeter(layer) as meter:
            out, _ = layer(x, attention_mask=None)
        out.sum().backward()
    assert x.grad is not None and layer.self_attention.core_attention.indexer is not None
    return meter.result().total_bytes


@pytest.mark.parametrize("loss", [None, 0.01])
def test_traced_layer_equals_the_meter_on_cores_real_layer(loss):
    """Without the indexer loss the indexer runs without grad (dsa.py L1979) and keeps nothing; with it, its
    projections, norm and RoPE keep their inputs and FusedDSAIndexerLoss keeps q, weights, k, the query, the key and
    the top-k indices (L944). Either way the trace keeps what Core's layer keeps."""
    fields = INDEXER | dict(dsa_indexer_loss_coeff=loss)
    assert _estimated(**fields) == _measured(**fields)


def test_the_indexer_loss_keeps_the_indexer_scores_inputs_and_the_top_k_indices():
    """The indexer loss adds at least its own saves of FusedDSAIndexerLoss (dsa.py L944) that nothing else keeps:
    the indexer's q [s, b, 2, 16], weights [s, b, 2], k [s, b, 16] (fp32) and the top-k indices [b, s, 8] (int64)."""
    s, b = 32, 2
    own = s * b * (2 * 16 + 2 + 16) * 4 + b * s * 8 * 8
    with_loss = _estimated(**INDEXER, dsa_indexer_loss_coeff=0.01)
    assert with_loss - _estimated(**INDEXER, dsa_indexer_loss_coeff=None) >= own


def _model(**fields):
    base = dict(multi_latent_attention=True, experimental_attention_variant="dsa", dsa_kernel_backend="none",
                dsa_indexer_rotate_activation=False, mla_down_proj_fusion=False, fp8=None, hybrid_layer_pattern=None,
                hybrid_override_pattern=None)
    return SimpleNamespace(**(base | fields))


def test_sparse_attention_is_modelled_and_multi_latent_attention_no_longer_refuses_it():
    assert dsa.findings(_model()) == [] and mla.findings(_model()) == []
    assert dsa.findings(_model(experimental_attention_variant=None)) == []


@pytest.mark.parametrize("fields, setting, words", [
    (dict(experimental_attention_variant="dsv4_hybrid"), "model.experimental_attention_variant",
     "in no released megatron-core"),
    (dict(experimental_attention_variant="gated_delta_net"), "model.experimental_attention_variant", "not modelled"),
    (dict(dsa_indexer_rotate_activation=True), "model.dsa_indexer_rotate_activation", "fast_hadamard_transform"),
])
def test_variants_not_modelled_are_named_with_why(fields, setting, words):
    [finding] = dsa.findings(_model(**fields))
    assert finding.setting == setting and words in finding.message and finding.fix


@pytest.mark.parametrize("backend", ["cudnn", "tilelang"])
def test_a_fused_kernel_backend_is_traced_on_cores_pytorch_path_and_said(backend):
    model = _model(dsa_kernel_backend=backend)
    note = dsa.turn_off_fused_kernels(model)
    assert model.dsa_kernel_backend == "none" and f"dsa_kernel_backend={backend}" in note and "upper bound" in note
    assert dsa.turn_off_fused_kernels(model) is None  # nothing left to turn off
    other = _model(experimental_attention_variant=None, dsa_kernel_backend="cudnn")
    assert dsa.turn_off_fused_kernels(other) is None and other.dsa_kernel_backend == "cudnn"


def test_te_modules_put_cores_name_back():
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    before = absorbed_mla.TELinear
    with dsa.te_modules():
        assert absorbed_mla.TELinear is mla.DuplicatedLinear
    assert absorbed_mla.TELinear is before


def test_the_estimate_names_what_it_traced_among_its_assumptions():
    assert "DSAttention" in dsa.assumption(_model())
    assert dsa.assumption(_model(experimental_attention_variant=None)) is None


SHARED = INDEXER | dict(dsa_indexer_topk_freq=4, dsa_indexer_skip_topk_offset=0, dsa_indexer_loss_coeff=0.01)
"""Top-k shared: layers 1 and 5 compute it, 2-4 reuse layer 1's, 6-8 layer 5's (dsa.py L37-56)."""


def _shared_config(layers: int, **fields):
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    shape = _shape()
    shape.layers = layers
    cfg = tiny_config(shape, None, **(SHARED | fields))
    cfg.model.pipeline_dtype = torch.float32
    return cfg


def _core_stage(prepared, stage: int):
    """The saves per layer of Core's real stage ``stage`` (Bridge's ``provide`` on that pipeline rank, its layers with
    their real numbers), one microbatch traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from megatron_bridge_ext.estimate.build import build_rank_model
    from megatron_bridge_ext.estimate.fake import fake_parallel_world
    from megatron_bridge_ext.estimate.trace import trace_microbatch

    provider = prepared.provider
    with fake_parallel_world(tp=1, pp=provider.pipeline_model_parallel_size, cp=1, rank=stage, device="cpu"), \
            dsa.indexer_loss_tracker():
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        model = build_rank_model(provider, None, attention="fused", mode=mode, device="cpu", dtype=prepared.dtype,
                                 transformer_impl="local")
        skips = [layer.self_attention.core_attention.skip_topk for layer in model.decoder.layers]
        traced = trace_microbatch(model, mode, seq=prepared.seq, micro_batch=prepared.micro_batch,
                                  hidden=provider.hidden_size, dtype=prepared.dtype, device="cpu",
                                  sequence_parallel_tp=1)
    return traced.by_layer, skips


def test_a_stage_of_shared_top_k_is_traced_with_its_layers_real_numbers():
    """PP 2 of 8 layers: stage 1 holds layers 5-8, of which 5 computes the top-k and 6-8 reuse it. The estimate traces
    the stage as two layers (the first and one that stands for the rest), which Core's build would number 3 and 4
    (3 reusing the top-k of a layer 1 not on the stage, so Core raises): built with their real numbers 5 and 6, their
    saves are those of Core's real stage, layer by layer (a layer reusing the top-k keeps no indexer)."""
    from megatron_bridge_ext.estimate import memory

    cfg = _shared_config(8, pipeline_model_parallel_size=2)
    prepared = memory.prepare(cfg, data_parallel_size=1, num_microbatches=2)
    assert memory.traced_layers(prepared.provider, 1).numbers == [4, 5]
    one = memory._estimate_stage(prepared, 1, attention="fused", impl="local", device="cpu")
    real, skips = _core_stage(prepared, 1)
    assert skips == [False, True, True, True]
    assert real[0] > real[1] == real[2] == real[3]
    assert one.activations_per_layer == real


def test_a_split_whose_chunk_starts_on_a_layer_reusing_another_stages_top_k_is_refused():
    """Stage 1 of layout ``Ett|ttttttL`` starts on layer 3, which reuses layer 1's top-k: Core raises in its forward
    (top-k is not shared across pipeline stages, dsa.py L1962-1973)."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.findings import Refused

    cfg = _shared_config(8, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|ttttttL")
    with pytest.raises(Refused) as refused:
        estimate(cfg, attention="fused", transformer_impl="local", device="cpu", num_microbatches=2)
    assert "model.dsa_indexer_topk_freq" in str(refused.value) and "layer 3 of pipeline stage 1" in str(refused.value)


def test_context_parallel_lengths_are_checked_by_shape():
    """Core checks that every CP rank holds as many tokens by all-gathering their values (dsa.py L220-250), which fake
    tensors do not carry: the stand-in accepts a key of the local or the gathered length and refuses another, and a
    tiny model at CP 2 is traced through it."""
    from megatron.core.transformer.experimental_attention_variant import dsa as core_dsa

    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    with dsa.cp_lengths_by_shape():
        core_dsa._validate_nonpacked_cp_uniform_length(sq=16, skv=32, cp_size=2, cp_group=None, device="cpu")
        with pytest.raises(RuntimeError):
            core_dsa._validate_nonpacked_cp_uniform_length(sq=16, skv=24, cp_size=2, cp_group=None, device="cpu")
    cfg = tiny_config(_shape(), None, **INDEXER, dsa_indexer_loss_coeff=0.01, context_parallel_size=2,
                      cp_comm_type="allgather")
    est = estimate(cfg, attention="fused", transformer_impl="local", device="cpu", data_parallel_size=1)
    assert est.settings.cp == 2 and est.activations_per_layer[1] > 0
