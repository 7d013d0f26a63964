"""The estimate's schedules and parallel-size checks: microbatches in flight, impossible layouts named."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate import configs
from megatron_bridge_ext.estimate.memory import microbatches_in_flight, parallel_problems
from megatron_bridge_ext.findings import Refused
from tests.support.estimate import QWEN3_8B

pytestmark = [pytest.mark.unit]


def test_microbatches_in_flight_follow_the_schedules():
    # 1F1B: stage k runs pp - k - 1 warm-up forwards, then one more before its first backward.
    assert microbatches_in_flight(pp=4, vpp=None, num_microbatches=8, stage=0) == 4
    assert microbatches_in_flight(pp=4, vpp=None, num_microbatches=8, stage=3) == 1
    assert microbatches_in_flight(pp=4, vpp=None, num_microbatches=2, stage=0) == 2
    assert microbatches_in_flight(pp=1, vpp=None, num_microbatches=16, stage=0) == 1
    # Interleaved, stage 0: Korthikanti et al.'s pp * (1 + (pp - 1) / (pp * vpp)).
    for pp, vpp in ((4, 2), (4, 5), (8, 3)):
        expected = pp * (1 + (pp - 1) / (pp * vpp))
        assert microbatches_in_flight(pp=pp, vpp=vpp, num_microbatches=64, stage=0) == pytest.approx(expected)


def test_impossible_parallel_sizes_name_the_setting():
    cfg = configs.from_hf_config(QWEN3_8B, configs.Layout(tp=3, seq=8192))
    problems = parallel_problems(cfg.model, micro_batch=1)
    assert problems and problems[0].setting == "model.tensor_model_parallel_size"
    assert "32 attention heads" in problems[0].message
    from megatron_bridge_ext.estimate import estimate

    with pytest.raises(Refused, match="TP=3 does not divide"):
        estimate(cfg)


def _latent_config(q_lora_rank=24, peft=None, **fields):
    """The tiny multi-latent attention model at TP 2 (kv_lora_rank 16, RoPE 8 wide), its config fields changed."""
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(tp=2, heads=4, kv_heads=4, mla=True, q_lora_rank=q_lora_rank, qk_layernorm=True)
    cfg = tiny_config(shape, peft)
    for name, value in fields.items():
        setattr(cfg.model, name, value)
    return cfg


def test_multi_latent_attention_refuses_what_it_cannot_trace_and_what_the_layout_cannot_split():
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.memory import NotModelled

    with pytest.raises(NotModelled, match="attention: unfused attention is not modelled with multi-latent"):
        estimate(_latent_config(), attention="local", transformer_impl="transformer_engine", device="cpu")
    with pytest.raises(Refused, match="model.q_lora_rank: TP=2 does not divide 25") as refused:
        estimate(_latent_config(q_lora_rank=25), attention="fused", transformer_impl="local", device="cpu")
    assert not isinstance(refused.value, NotModelled)  # a layout problem, not a feature left out


def test_dora_on_the_latent_projections_is_refused_before_anything_is_built():
    from megatron.bridge.peft.dora import DoRA

    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.memory import NotModelled

    peft = DoRA(target_modules=["linear_proj", "linear_kv_up_proj"], dim=8, alpha=16)
    with pytest.raises(NotModelled, match="peft.target_modules: DoRA adapters on multi-latent attention's "
                                          "linear_kv_up_proj"):
        estimate(_latent_config(peft=peft), attention="fused", device="cpu")


def test_fused_yarn_rope_on_multi_latent_attention_is_traced_unfused_and_said():
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.features.mla import ROPE_FUSION_NOTE

    est = estimate(_latent_config(apply_rope_fusion=True), attention="fused", device="cpu")
    assert ROPE_FUSION_NOTE in est.assumptions
    assert not any(a.startswith("apply_rope_fusion: RoPE fusion needs Transformer Engine") for a in est.assumptions)


def test_tp_a_multiple_of_the_query_groups_is_accepted_as_core_accepts_it():
    """Core takes TP a divisor or a multiple of the query groups (transformer_config.py L1338-1345); with TP a
    multiple, each rank computes its share of the key/value projection and gathers it (attention.py L353-379,
    L1839-1858): the weights per rank shrink with the groups, they are not replicated."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    def weights(kv_heads):
        cfg = tiny_config(TinyGPTShape(tp=1, layers=2, heads=4, kv_heads=kv_heads, hidden=64, ffn=128, seq=32))
        cfg.model.tensor_model_parallel_size, cfg.model.sequence_parallel = 4, True
        est = estimate(cfg, device="cpu", attention="fused", transformer_impl="local")
        return est.component("weights: transformer layers").bytes

    layers, head_dim, hidden, tp, fp32 = 2, 64 // 4, 64, 4, 4
    assert weights(4) - weights(2) == layers * 2 * (4 - 2) * head_dim * hidden // tp * fp32  # k and v of 2 groups
    cfg = configs.from_hf_config(QWEN3_8B, configs.Layout(tp=16, seq=8192))  # 32 heads, 8 query groups
    assert not [p for p in parallel_problems(cfg.model, micro_batch=1) if "query groups" in p.message]
    cfg = configs.from_hf_config(QWEN3_8B, configs.Layout(tp=1, seq=8192))
    cfg.model.tensor_model_parallel_size, cfg.model.num_query_groups = 4, 6  # neither divides the other
    problems = [p for p in parallel_problems(cfg.model, micro_batch=1) if "query groups" in p.message]
    assert problems and problems[0].setting == "model.tensor_model_parallel_size"


def test_sequence_parallel_off_with_tp_on_an_moe_model_cites_the_line_of_core_that_refuses_it():
    """Core's ``MoELayer.forward`` raises in training when attention's TP group is larger than one and sequence
    parallelism is off (Bridge's GLM-4.5 355B PEFT and SFT recipes ship so): run with a stand-in for the layer's
    state, the line it raises from is the one the finding cites."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from tests.support.cited import cites, raised_at

    layer = SimpleNamespace(training=True, attn_tp_group=SimpleNamespace(size=lambda: 2),
                            config=SimpleNamespace(sequence_parallel=False))
    file, line = raised_at(lambda: MoELayer.forward(layer, None), ValueError)
    cfg = configs.from_hf_config(QWEN3_8B, configs.Layout(tp=2, seq=8192))
    cfg.model.num_moe_experts, cfg.model.sequence_parallel = 8, False
    [problem] = [p for p in parallel_problems(cfg.model, micro_batch=1) if p.setting == "model.sequence_parallel"]
    assert cites(problem.message, f"moe/{file}", line), (file, line, problem.message)
