"""The memory estimate (`estimate(cfg)`) on public model shapes (tests/data/*/config.json), against hand computation.

Every static component is recomputed here from the config.json fields with Megatron's sharding
rules (TP shards of each linear, vocabulary split, replicated norms, LoRA adapter shapes), and the
LoRA inputs and Transformer Engine shards from the shapes of the tensors each adapter keeps. The
activations as a whole are checked against real runs by the validation grid.
"""

from __future__ import annotations

import json
import os

import pytest

from megatron_bridge_ext.estimate import configs
from megatron_bridge_ext.estimate.trace import ATTENTION, LORA_INPUTS, MLP, NORMS
from megatron_bridge_ext.findings import Refused
from tests.support.estimate import DATA, DP, QWEN3_8B, RANK, SEQ, TP, adapter_params, layer_params

pytestmark = [pytest.mark.unit]

LLAMA3_8B = os.path.join(DATA, "llama-3-8b", "config.json")
BF16 = 2


def _hf(path):
    with open(path) as handle:
        return json.load(handle)


def test_static_components_of_qwen3_8b_lora_match_hand_computation(qwen_lora):
    _, est = qwen_lora
    hf = _hf(QWEN3_8B)
    h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    embedding = vocab * h // TP
    frozen_layers = layers * layer_params(hf, TP) + h  # + the final norm
    adapters = layers * adapter_params(hf, TP, RANK)
    assert est.component("weights: embedding").bytes == embedding * BF16
    assert est.component("weights: output layer").bytes == embedding * BF16  # untied, V/t rows on the last stage
    assert est.component("weights: transformer layers").bytes == frozen_layers * BF16
    assert est.component("weights: adapters").bytes == adapters * BF16
    # bf16_mixed reduces gradients in fp32; only the adapters have them.
    assert est.component("gradients (main_grad buffer)").bytes == adapters * 4
    # Distributed Adam: fp32 main copy + two fp32 moments, over DP ranks.
    assert est.component("optimizer states").bytes == -(-adapters * 12 // DP)


def test_lora_inputs_and_te_shards_of_qwen3_8b_match_their_shapes(qwen_lora):
    _, est = qwen_lora
    hf = _hf(QWEN3_8B)
    h, ffn, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    s, b = SEQ, 1
    # Per layer: LoRA-A of qkv and fc1 keep the gathered [s, b, h] norm output (Bridge's path), LoRA-A of
    # fc2 its [s, b, ffn/t] input, each LoRA-B its [s, b, r] input; proj's LoRA-A input is the attention
    # output, which the attention keeps first.
    lora = layers * (2 * s * b * h + s * b * ffn // TP + 4 * s * b * RANK) * BF16
    assert est.activations_per_microbatch[LORA_INPUTS] == lora
    # Transformer Engine's LayerNormLinear keeps its [s/t, b, h] shard next to each gathered copy.
    assert est.component("TE norm-output shards (contract)").bytes == 2 * layers * (s // TP) * b * h * BF16
    logits = est.component("logits at the loss")
    assert logits.bytes == s * b * (hf["vocab_size"] // TP) * BF16


def _each_stage(cfg, stages) -> dict:
    """Every stage's own estimate (``estimate`` reports only the most loaded one), traced as ``estimate`` traces it."""
    from megatron_bridge_ext.estimate import memory

    prepared = memory.prepare(cfg, data_parallel_size=None, num_microbatches=None)
    attention = memory._attention_from(prepared.provider)
    return {stage: memory._estimate_stage(prepared, stage, attention=attention, device="cuda",
                                          impl=prepared.provider.transformer_impl) for stage in stages}


def test_first_and_last_pipeline_stage_hold_the_embedding_and_the_output_layer():
    """Full fine-tuning of Llama 3 8B cut to 4 layers, PP 2 x TP 2 x DP 2: stage 0 holds the vocabulary-parallel
    embedding (V/t x h) and 2 layers, stage 1 2 layers, the final norm (h) and the output layer (V/t x h, untied);
    every parameter trains, so gradients are 4 B each (bf16_mixed reduces in fp32) and the distributed Adam state
    12 B each over DP = 2."""
    from megatron_bridge_ext.estimate import estimate

    hf = _hf(LLAMA3_8B)
    cfg = configs.from_hf_config(LLAMA3_8B, configs.Layout(tp=2, pp=2, dp=2, seq=512, peft="none"),
                                 ["model.num_layers=4"])
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    assert vocab % 2 == 0  # Bridge's GPT provider does not pad it (should_pad_vocab=False, gpt_provider.py:183)
    vocab_part = vocab // 2 * h
    layers = 2 * layer_params(hf, 2)
    stages = _each_stage(cfg, (0, 1))
    first, last = stages[0], stages[1]
    assert {c.name for c in first.components if c.name.startswith("weights")} == \
        {"weights: embedding", "weights: transformer layers"}
    assert {c.name for c in last.components if c.name.startswith("weights")} == \
        {"weights: output layer", "weights: transformer layers"}
    assert first.component("weights: embedding").bytes == vocab_part * BF16
    assert last.component("weights: output layer").bytes == vocab_part * BF16
    assert first.component("weights: transformer layers").bytes == layers * BF16
    assert last.component("weights: transformer layers").bytes == (layers + h) * BF16  # + the final norm
    # 1F1B with 2 microbatches: the first of 2 stages holds both in flight, the last one
    assert (first.in_flight_microbatches, last.in_flight_microbatches) == (2, 1)
    for est, params in ((first, vocab_part + layers), (last, vocab_part + layers + h)):
        assert est.component("gradients (main_grad buffer)").bytes == params * 4
        assert est.component("optimizer states").bytes == -(-params * 12 // 2)
    assert estimate(cfg).stage_peaks == {0: first.peak_bytes, 1: last.peak_bytes}


def test_identical_layers_save_the_same_and_split_the_layer_categories(qwen_lora):
    _, est = qwen_lora
    layers = est.activations_per_layer
    assert sorted(layers) == list(range(36))
    assert len({layers[i] for i in range(1, 36)}) == 1  # 35 identical layers after the first
    # The first layer's input comes from the frozen embedding: Bridge's LoRA-A there has no input gradient path.
    assert layers[0] <= layers[1]
    in_layers = sum(est.activations_per_microbatch[c] for c in (NORMS, ATTENTION, MLP, LORA_INPUTS))
    hf = _hf(QWEN3_8B)
    final_norm = (SEQ // TP) * hf["hidden_size"] * BF16 + (SEQ // TP) * 4  # its input and fp32 rstd
    assert sum(layers.values()) == in_layers - final_norm


def _tiny_kind(kind: str, **fields):
    """The demo's tiny GPT (bf16, SwiGLU, TP 2 with SP) under Bridge's PEFT of ``kind`` (its gathered path)."""
    from megatron_bridge_ext.peft import kinds
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, peft_fields, tiny_config

    shape = TinyGPTShape(tp=2, sequence_parallel=True, swiglu=True, dtype="bfloat16", peft=kind)
    return shape, tiny_config(shape, kinds.bridge_class(kind)(**peft_fields(shape), **fields))


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_canonical_lora_inputs_against_lora_from_the_shapes(impl):
    """CanonicalLoRA adapts linear_qkv with three adapters and linear_fc1 with two, each with its [s, b, r]
    LoRA-B input: three more than LoRA per layer. On the local spec each of them gathers the layer's
    [s, b, h] input for itself (three more gathered copies per layer); Transformer Engine gathers once
    and shares it, so under its contract only the LoRA-B inputs differ, and both kinds add the same
    norm-output shard per LayerNormLinear."""
    from megatron_bridge_ext.estimate import estimate

    ests = {}
    for kind in ("lora", "canonical_lora"):
        shape, cfg = _tiny_kind(kind)
        ests[kind] = estimate(cfg, attention="local", transformer_impl=impl, device="cpu")
    s, b, h, r, layers = shape.seq, shape.micro_batch, shape.hidden, shape.lora_rank, shape.layers
    extra_b_inputs = layers * 3 * s * b * r * BF16
    extra_copies = layers * 3 * s * b * h * BF16 if impl == "local" else 0
    lora_inputs = {kind: est.component(LORA_INPUTS).bytes for kind, est in ests.items()}
    assert lora_inputs["canonical_lora"] - lora_inputs["lora"] == extra_b_inputs + extra_copies
    if impl == "transformer_engine":
        shard = layers * 2 * (s // shape.tp) * b * h * BF16  # linear_qkv's and linear_fc1's own norm output
        for est in ests.values():
            assert est.component("TE norm-output shards (contract)").bytes == shard


def test_dora_with_dropout_on_transformer_engine_under_sp_is_refused():
    from megatron_bridge_ext.estimate import estimate

    _, cfg = _tiny_kind("dora", dropout=0.1)
    with pytest.raises(Refused) as refused:
        estimate(cfg, attention="local", transformer_impl="transformer_engine", device="cpu")
    line = refused.value.one_line()
    assert "peft.dropout" in line and "set peft.dropout=0.0" in line and "\n" not in line
    # The local spec runs it (its base linears take the dropout correction's shard).
    assert estimate(cfg, attention="local", transformer_impl="local", device="cpu").peak_bytes > 0


def test_dora_builds_on_the_traced_cuda_device_and_adds_its_magnitude_vectors_to_lora():
    """DoRA's adapter takes, when it is built, the norm of its base weight gathered over TP (Megatron's
    gather allocates on the current CUDA device). The estimate builds it on the CPU as it builds LoRA
    and traces on fake CUDA tensors: DoRA's weights are LoRA's plus one trainable magnitude per output
    row of each adapted linear (column-parallel: this rank's rows; row-parallel: all h rows)."""
    from megatron_bridge_ext.estimate import estimate

    ests = {}
    for kind in ("lora", "dora"):
        shape, cfg = _tiny_kind(kind)
        ests[kind] = estimate(cfg, attention="local", transformer_impl="local", device="cuda")
    h, ffn, tp, layers = shape.hidden, shape.ffn, shape.tp, shape.layers
    head_dim = h // shape.heads
    qkv_rows = (shape.heads + 2 * shape.kv_heads) * head_dim // tp
    fc1_rows = 2 * ffn // tp  # SwiGLU: gate and up
    magnitudes = layers * (qkv_rows + h + fc1_rows + h)  # qkv, proj, fc1, fc2

    def part(kind, name):
        return ests[kind].component(name).bytes

    assert part("dora", "weights: adapters") - part("lora", "weights: adapters") == magnitudes * BF16
    grads = "gradients (main_grad buffer)"
    grad_bytes = 4 if cfg.ddp.grad_reduce_in_fp32 else BF16
    assert part("dora", grads) - part("lora", grads) == magnitudes * grad_bytes
    assert part("dora", "weights: transformer layers") == part("lora", "weights: transformer layers")


def _tied_llama(tmp_path):
    """Llama-3-8B's config.json with tied word embeddings (as Llama-3.2-1B and Qwen3's small models have)."""
    hf = _hf(LLAMA3_8B)
    hf["tie_word_embeddings"] = True
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    return hf, str(path)


def test_tied_embeddings_count_the_shared_weight_once_on_one_stage(tmp_path):
    """With PP=1 Core's output layer allocates no weight and multiplies by the embedding's: one [V/t, h]
    matrix for both, and the logits still have V/t columns."""
    from megatron_bridge_ext.estimate import estimate

    hf, path = _tied_llama(tmp_path)
    cfg = configs.from_hf_config(path, configs.Layout(tp=2, dp=2, seq=512, peft="none"), ["model.num_layers=2"])
    assert cfg.model.share_embeddings_and_output_weights
    est = estimate(cfg)
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    assert "weights: output layer" not in {c.name for c in est.components}
    assert est.component("weights: embedding").bytes == vocab * h // 2 * BF16
    weights = vocab * h // 2 + 2 * layer_params(hf, 2) + h  # shared matrix, 2 layers, the final norm
    assert sum(c.bytes for c in est.components if c.name.startswith("weights")) == weights * BF16
    assert est.component("gradients (main_grad buffer)").bytes == weights * 4  # full fine-tuning
    assert est.component("logits at the loss").bytes == 512 * (vocab // 2) * BF16


def test_tied_embeddings_keep_a_copy_on_the_last_of_two_stages(tmp_path):
    """With PP>1 Core's last stage keeps its own copy of the shared weight as the output layer's (kept equal
    to the first stage's by an all-reduce), so both stages hold what they hold untied."""
    from megatron_bridge_ext.estimate import estimate

    _, path = _tied_llama(tmp_path)
    layout = configs.Layout(tp=2, pp=2, dp=2, seq=512, peft="none")
    tied_cfg = configs.from_hf_config(path, layout, ["model.num_layers=4"])
    assert tied_cfg.model.share_embeddings_and_output_weights
    tied = estimate(tied_cfg)
    untied = estimate(configs.from_hf_config(LLAMA3_8B, layout, ["model.num_layers=4"]))
    assert tied.stage_peaks == untied.stage_peaks
