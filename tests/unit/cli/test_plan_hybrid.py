"""``mbx plan`` on Bridge's Nemotron 3 Nano recipes (a hybrid Mamba / attention / MoE model) and on configs that
capture CUDA graphs: the recipes as shipped are estimated with their ``flex`` dispatcher (HybridEP for pretraining,
DeepEP for PEFT) beside Bridge's figure; with Core's all-to-all dispatcher, a per-rank estimate whose Mamba layers are
traced.

The layer counts and Mamba sizes expected here are the model card's (23 Mamba-2 layers of 64 heads of 64, 8 groups,
state 128; 23 MoE layers, 6 attention layers, hidden 2688 of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16), not read
from the recipe."""

from __future__ import annotations

import json
import os

import pytest

from megatron_bridge_ext import cli

pytestmark = [pytest.mark.unit]

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
NANO_CONFIG = os.path.join(DATA, "nemotron-3-nano-30b-a3b", "config.json")
RECIPES = "megatron.bridge.recipes.nemotronh.nemotron_3_nano"
PRETRAIN = f"{RECIPES}:nemotron_3_nano_pretrain_config"
PEFT = f"{RECIPES}:nemotron_3_nano_peft_config"
ALLTOALL = "model.moe_token_dispatcher_type=alltoall"
MAMBA_LAYERS, HEADS, HEAD_DIM, GROUPS, STATE = 23, 64, 64, 8, 128
VANILLA = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"
TINY = ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_attention_heads=8",
        "model.vocab_size=1024", "model.share_embeddings_and_output_weights=false"]


def _plan(capsys, *argv) -> tuple[int, str, str]:
    status = cli.main(["plan", "--gpu-memory", "80GiB", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def _line(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def test_the_pretrain_recipe_is_estimated_on_hybridep_and_names_its_cuda_graphs(capsys):
    """The recipe builds its model in Python (no hub read), leaves vocab_size to the tokenizer (named before
    either estimate runs: both need it), dispatches on HybridEP (TP 1 x EP 8, traced) and captures attention and
    Mamba layers in Transformer Engine CUDA graphs."""
    assert cli.main(["plan", "--recipe", PRETRAIN, "--dp", "8", "--gpu-memory", "80GiB"]) == 2
    assert capsys.readouterr().err.startswith("mbx plan: model.vocab_size: is unset: the recipe leaves it to the "
                                              "tokenizer (cfg.tokenizer.")
    status, out, _ = _plan(capsys, "--recipe", PRETRAIN, "--dp", "8", "model.vocab_size=131072")
    assert status == 0 and not _line(out, "our estimate: ")
    assert "  - flex dispatcher on HybridEP: stand-ins for its dispatch and combine" in out
    [graphs] = _line(out, "not modelled: ")
    assert graphs.startswith("not modelled: CUDA graph memory pools (model.cuda_graph_impl='transformer_engine', "
                             "modules ['attn', 'mamba']) are partly modelled")
    assert "  CUDA-graph capture (largest)" in out  # the static buffers of its attention and Mamba layers


def test_with_its_vocabulary_bridges_figure_stands_beside_the_estimate_with_its_caveat(capsys):
    status, out, _ = _plan(capsys, "--recipe", PRETRAIN, "--dp", "8", "--json", "model.vocab_size=131072")
    assert status == 0
    report = json.loads(out)
    assert report["estimate_refused"] in (None, []) and report["bridge_estimate_error"] is None
    [hybridep] = [a for a in report["estimate"]["assumptions"] if a.startswith("flex dispatcher on HybridEP")]
    assert "the group of 8" in hybridep
    assert report["bridge_estimate"]["total_bytes"] > 0
    assert report["bridge_estimate"]["caveats"] == [
        "Bridge's formula reads no hybrid pattern: it counts all 52 layers as attention + MoE layers, where this "
        "model has 23 Mamba, 6 attention, 23 MoE"]
    [graphs] = report["not_modelled"]
    assert "CUDA graph memory pools" in graphs


def test_the_peft_recipe_reads_its_config_from_the_local_file_and_is_estimated_on_deepep(capsys):
    """The HF config's bridge gives the PEFT recipe the flex dispatcher on DeepEP (TP 1 x EP 8), which is traced;
    it captures no graphs."""
    status, out, _ = _plan(capsys, "--recipe", PEFT, "--hf-config", NANO_CONFIG, "--dp", "8", "--json")
    assert status == 0
    report = json.loads(out)
    assert report["estimate_refused"] in (None, [])
    [deepep] = [a for a in report["estimate"]["assumptions"] if a.startswith("flex dispatcher on DeepEP")]
    assert "TP x EP group of 8" in deepep
    assert report["not_modelled"] == []


def test_with_all_to_all_the_peft_recipe_is_estimated_with_its_mamba_layers_traced(capsys):
    """Bridge's LoRA recipe adapts in_proj and out_proj (frozen bases, frozen A_log): each Mamba layer keeps the scan's
    input zxbcdt [s, in_proj], its ungated output and the gated norm's input [s, d_inner], the norm's fp32 rstd per
    group and token, and two fp32 head vectors (A and dt_bias cast), at sequence 2048, micro-batch 1, TP 1."""
    status, out, _ = _plan(capsys, "--recipe", PEFT, "--hf-config", NANO_CONFIG, "--dp", "8", "--json", ALLTOALL)
    assert status == 0
    report = json.loads(out)
    estimate = report["estimate"]
    assert estimate["settings"]["hybrid_layers"] == {"Mamba": MAMBA_LAYERS, "attention": 6, "MoE": 23}
    seq, inner = 2048, HEADS * HEAD_DIM
    in_proj = 2 * inner + 2 * GROUPS * STATE + HEADS
    per_layer = 2 * seq * (in_proj + 2 * inner) + 4 * GROUPS * seq + 2 * 4 * HEADS
    assert estimate["activations_per_microbatch"]["mamba"] == MAMBA_LAYERS * per_layer
    assert report["bridge_estimate"]["caveats"][0].startswith("Bridge's formula reads no hybrid pattern")
    assert report["estimate_refused"] is None


def test_with_all_to_all_the_text_plan_names_the_hybrid_layers_and_the_stand_ins(capsys):
    status, out, _ = _plan(capsys, "--recipe", PEFT, "--hf-config", NANO_CONFIG, "--dp", "8", ALLTOALL)
    assert status == 0
    [config] = _line(out, "config: ")
    assert ", hybrid: 23 Mamba, 6 attention, 23 MoE, 128 experts (top-6, 16 on this rank, alltoall dispatcher)" in config
    assert _line(out, "  activations  mamba ")
    assert "  - hybrid model: Megatron Core's hybrid stack on the local backend" in out


def test_a_dense_config_with_cuda_graphs_is_estimated_eagerly_and_names_the_pools(capsys):
    status, out, _ = _plan(capsys, "--recipe", VANILLA, *TINY, "model.cuda_graph_impl=local",
                           "model.use_te_rng_tracker=true")
    assert status == 0
    [graphs] = _line(out, "not modelled: ")
    assert graphs.startswith("not modelled: CUDA graph memory pools (model.cuda_graph_impl='local', modules ['full'])")
    assert "fits as is" in out
    assert "  - CUDA graphs (model.cuda_graph_impl='local', modules ['full']) traced eagerly" in out


def test_cuda_graphs_without_te_rng_tracker_are_one_line_and_exit_2(capsys):
    status, out, err = _plan(capsys, "--recipe", VANILLA, *TINY, "model.enable_cuda_graph=true")
    assert status == 2 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("mbx plan: model.use_te_rng_tracker: is off with CUDA graphs on "
                           "(model.enable_cuda_graph=True (cuda_graph_impl 'local'))")
    assert "Fix: set model.use_te_rng_tracker=True" in line
