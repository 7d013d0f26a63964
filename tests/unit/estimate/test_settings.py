"""The estimate's settings: one frozen object read by attribute, and ``to_json`` giving the flat dict of
``mbx plan --json`` with its keys in their order (dense full fine-tuning, MoE with LoRA, a hybrid Mamba model)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron_bridge_ext.estimate import configs, memory
from megatron_bridge_ext.estimate.settings import Settings
from tests.support.estimate import DATA, QWEN3_8B

pytestmark = [pytest.mark.unit]

QWEN3_30B_A3B = os.path.join(DATA, "qwen3-30b-a3b", "config.json")
NANO = os.path.join(DATA, "nemotron-3-nano-30b-a3b", "config.json")

# The keys of ``estimate.settings`` in ``mbx plan --json``, in order, written out from the estimate's settings as the
# docs name them: the layout and shapes, the PEFT keys (two under full fine-tuning), a hybrid model's, Bridge's
# reporting settings, an MoE model's.
LAYOUT_AND_SHAPES = ["tp", "pp", "vpp", "cp", "dp", "sequence_parallel", "seq_length", "micro_batch",
                     "num_microbatches", "dtype", "fp8", "stage", "layers_on_stage", "hidden", "ffn", "heads",
                     "query_groups", "kv_channels", "num_layers", "gated_linear_unit", "vocab_size",
                     "recompute_granularity", "recompute_modules", "attention", "transformer_impl", "device",
                     "distributed_optimizer", "tp_comm_overlap", "fsdp", "moment_bytes", "optimizer_offload",
                     "optimizer_offload_overlap"]
FULL_FINE_TUNING = ["peft", "peft_kind"]
PEFT = ["peft", "peft_kind", "lora_dim", "lora_targets", "sequence_parallel_input_strategy"]
HYBRID = ["hybrid_layers", "mamba"]
REPORTS = ["log_interval", "train_iters", "cuda_graph_first_iteration", "wgrad_deferral_limit"]
MOE = ["num_moe_experts", "moe_router_topk", "moe_ffn", "ep", "etp", "local_experts", "moe_token_dispatcher",
       "moe_imbalance", "moe_layers_on_stage", "routed_tokens_per_layer", "moe_shared_ffn"]
MLA = ["mla_q_lora_rank", "mla_kv_lora_rank", "mla_qk_head_dim", "mla_qk_pos_emb_head_dim", "mla_v_head_dim"]


@pytest.fixture(scope="module")
def dense():
    """Qwen3-8B's config.json shrunk to 2 layers, TP 2 with SP, full fine-tuning."""
    layout = configs.Layout(tp=2, dp=2, seq=128)
    overrides = ["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256",
                 "model.num_attention_heads=8", "model.num_query_groups=4", "model.kv_channels=16",
                 "model.vocab_size=1024"]
    return memory.estimate(configs.from_hf_config(QWEN3_8B, layout, overrides))


@pytest.fixture(scope="module")
def moe_lora():
    """Qwen3-MoE's config.json shrunk: top-2 of 8 experts on EP 4, TP 2, LoRA r8 (as test_estimate_moe.py)."""
    layout = configs.Layout(tp=2, ep=4, dp=4, seq=128, peft="lora", lora_dim=8, lora_alpha=8)
    overrides = ["model.num_layers=3", "model.hidden_size=128", "model.ffn_hidden_size=256",
                 "model.moe_ffn_hidden_size=64", "model.num_moe_experts=8", "model.moe_router_topk=2",
                 "model.num_attention_heads=8", "model.num_query_groups=4", "model.kv_channels=16",
                 "model.vocab_size=1024", "model.moe_token_dispatcher_type=alltoall"]
    return memory.estimate(configs.from_hf_config(QWEN3_30B_A3B, layout, overrides))


@pytest.fixture(scope="module")
def hybrid():
    """Nemotron 3 Nano's config.json shrunk to Mamba, attention and MoE layers (as test_estimate_hybrid.py)."""
    layout = configs.Layout(tp=2, ep=2, dp=2, seq=128)
    overrides = ["model.num_layers=3", "model.hybrid_layer_pattern=M*E", "model.hidden_size=64",
                 "model.mamba_num_heads=8", "model.mamba_head_dim=16", "model.mamba_num_groups=2",
                 "model.mamba_state_dim=16", "model.mamba_chunk_size=32", "model.num_attention_heads=4",
                 "model.num_query_groups=2", "model.kv_channels=16", "model.ffn_hidden_size=96",
                 "model.moe_ffn_hidden_size=32", "model.num_moe_experts=4", "model.moe_router_topk=2",
                 "model.moe_shared_expert_intermediate_size=48", "model.vocab_size=512",
                 "model.moe_token_dispatcher_type=alltoall"]
    return memory.estimate(configs.from_hf_config(NANO, layout, overrides))


@pytest.fixture(scope="module")
def latent():
    """The tiny multi-latent attention model (q_lora_rank 24, kv_lora_rank 16, head widths 16 + 8 and 12), TP 2."""
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(tp=2, heads=4, kv_heads=4, mla=True, q_lora_rank=24, qk_layernorm=True)
    return memory.estimate(tiny_config(shape), attention="fused", transformer_impl="transformer_engine", device="cpu")


def test_a_dense_full_fine_tuning_estimate_serialises_todays_keys_in_order(dense):
    out = dense.settings.to_json()
    assert list(out) == LAYOUT_AND_SHAPES + FULL_FINE_TUNING + REPORTS
    assert (out["tp"], out["sequence_parallel"], out["dp"], out["seq_length"]) == (2, True, 2, 128)
    assert out["num_layers"] == out["layers_on_stage"] == 2
    assert (out["hidden"], out["query_groups"], out["peft"], out["peft_kind"]) == (128, 4, None, None)
    assert out["recompute_modules"] == list(dense.settings.recompute_modules)  # a list, as JSON has it
    assert out["cuda_graph_first_iteration"] is None and out["wgrad_deferral_limit"] is None  # no graphs, no deferral


def test_an_moe_lora_estimate_serialises_the_peft_keys_then_the_experts(moe_lora):
    s = moe_lora.settings
    out = s.to_json()
    assert list(out) == LAYOUT_AND_SHAPES + PEFT + REPORTS + MOE
    assert out["peft"] == "megatron.bridge.peft.lora.LoRA" and out["peft_kind"] == "lora" and out["lora_dim"] == 8
    assert out["lora_targets"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]  # a list, as JSON has it
    assert (out["num_moe_experts"], out["moe_router_topk"], out["ep"], out["local_experts"]) == (8, 2, 4, 2)
    assert (out["moe_layers_on_stage"], out["moe_shared_ffn"], out["moe_imbalance"]) == (3, 0, 1.0)
    assert out["routed_tokens_per_layer"] == s.moe.routed_tokens_per_layer > 0


def test_a_hybrid_estimate_serialises_its_layers_and_mamba_sizes_before_the_reports(hybrid):
    out = hybrid.settings.to_json()
    assert list(out) == LAYOUT_AND_SHAPES + FULL_FINE_TUNING + HYBRID + REPORTS + MOE
    assert out["hybrid_layers"] == {"Mamba": 1, "attention": 1, "MoE": 1}
    assert out["mamba"] == {"heads": 8, "head_dim": 16, "groups": 2, "state": 16, "chunk": 32}  # the whole mixer's
    assert out["moe_shared_ffn"] == 48


def test_a_multi_latent_estimate_serialises_its_latent_sizes_last(latent):
    out = latent.settings.to_json()
    assert list(out) == LAYOUT_AND_SHAPES + FULL_FINE_TUNING + REPORTS + MLA
    assert [out[key] for key in MLA] == [24, 16, 16, 8, 12]


def test_the_estimates_dict_carries_the_flat_settings_and_they_read_back(dense, moe_lora, hybrid, latent):
    for est in (dense, moe_lora, hybrid, latent):
        flat = est.as_dict()["settings"]
        assert flat == est.settings.to_json()
        assert Settings.from_json(json.loads(json.dumps(flat))) == est.settings


def test_a_json_from_before_tp_comm_overlap_reads_it_as_off(dense):
    flat = {k: v for k, v in dense.settings.to_json().items() if k != "tp_comm_overlap"}
    assert Settings.from_json(flat).tp_comm_overlap is False


def test_a_json_from_before_fsdp_reads_it_as_ddp_with_fp32_moments(dense):
    flat = {k: v for k, v in dense.settings.to_json().items() if k not in ("fsdp", "moment_bytes")}
    assert (Settings.from_json(flat).fsdp, Settings.from_json(flat).moment_bytes) == (None, 4 + 4)


def test_a_json_from_before_the_optimizer_offload_reads_it_as_off(dense):
    flat = {k: v for k, v in dense.settings.to_json().items() if not k.startswith("optimizer_offload")}
    assert (Settings.from_json(flat).optimizer_offload, Settings.from_json(flat).optimizer_offload_overlap) == \
        (None, False)


def test_an_unknown_key_is_refused_by_name(dense):
    with pytest.raises(ValueError, match="unknown key.*moe_layers_on_stag"):
        Settings.from_json({**dense.settings.to_json(), "moe_layers_on_stag": 1})


def test_a_misspelt_setting_fails_where_it_is_read(moe_lora):
    s = moe_lora.settings
    with pytest.raises(AttributeError, match="'moe_layers_on_stag'"):
        s.moe_layers_on_stag
    with pytest.raises(AttributeError, match="'layers_on_stag'"):
        s.moe.layers_on_stag
    with pytest.raises(AttributeError, match="'get'"):
        s.get("tp")


def test_the_settings_are_frozen(dense):
    s = dense.settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tp = 4
    # A name that is no field: Python 3.12.1's frozen slots class raises TypeError (its __setattr__ calls super() on
    # the class from before slots were added); later releases raise FrozenInstanceError. Either way nothing is set.
    with pytest.raises((dataclasses.FrozenInstanceError, TypeError)):
        s.tp_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.reports.log_interval = 10
    assert s.tp == 2 and not hasattr(s, "tp_size")


def test_no_dict_access_remains(dense):
    with pytest.raises(TypeError):
        dense.settings["tp"]
    with pytest.raises(TypeError):
        "tp" in dense.settings
