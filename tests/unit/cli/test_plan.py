"""``mbx plan``: bad input gives one line and exit status 2 before anything is built; good input prints
the estimate beside Bridge's, the levers in order and the answer (text, JSON, plot)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_bridge_ext import cli, planner
from megatron_bridge_ext.cli import plan as plan_cli
from megatron_bridge_ext.render import plan as render_plan
from megatron_bridge_ext.render import plan_plot
from tests.support.estimate import adapter_params, layer_params
from tests.support.settings import gpt_stage

pytestmark = [pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[3]
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
QWEN3_8B = os.path.join(DATA, "qwen3-8b", "config.json")
LLAMA3_8B = os.path.join(DATA, "llama-3-8b", "config.json")


def _one_line_error(capsys, argv) -> str:
    assert cli.main(["plan", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("mbx plan: ")
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--recipe", "no_such_package.recipes:config"], "--recipe: cannot import 'no_such_package.recipes'"),
    (["--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt"], "is not MODULE:FUNCTION"),
    (["--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:no_such_recipe"], "has no function 'no_such_recipe'"),
    (["--hf-config", "/no/such/config.json"], "no such file"),
    (["--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config", "--dp", "4",
      "train.global_batch_size=6"], "train.global_batch_size: 6 is not a multiple of micro-batch x DP = 2 x 4 = 8 (each step runs whole "
                                     "microbatches on every data-parallel replica). Fix: give a multiple of 8, e.g. "
                                     "train.global_batch_size=8"),
    # the micro-batch the user changed is named, not the recipe's global batch of 32 (32 / DP 4 = 8: 2 and 4 nearest)
    (["--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config", "--dp", "4",
      "train.micro_batch_size=3"], "train.micro_batch_size: 3 with DP 4 does not divide the recipe's global batch of "
                                   "32 sequences"),
    (["--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config", "--dp", "4",
      "--micro-batch", "3"], "Fix: give a micro-batch that divides 32 / DP, e.g. 2 or 4"),
])
def test_bad_input_is_one_line(capsys, argv, expected):
    line = _one_line_error(capsys, [*argv, "--gpu-memory", "80GiB"])
    assert expected in line
    assert ". Fix: " in line


FAST_REFUSALS = [
    (["--tp", "3"], "model.tensor_model_parallel_size: TP=3 does not divide the 32 attention heads. Fix: choose "
                    "sizes that divide it"),
    (["--tp", "2", "--seq", "8191"], "model.seq_length: sequence 8191 is not divisible by TP=2"),
    (["--pp", "5"], "model.pipeline_model_parallel_size: PP=5 does not divide the 36 layers"),
    (["--micro-batch", "0"], "--micro-batch: 0 is not a whole number of 1 or more. Fix: give e.g. --micro-batch 1"),
    (["--tp", "-2"], "--tp: -2 is not a whole number of 1 or more"),
    (["--lora-dim", "0"], "--lora-dim: 0 is not a whole number of 1 or more"),
    (["--dp", "4", "--global-batch", "6"], "--global-batch: 6 is not a multiple of micro-batch x DP = 1 x 4 = 4 "
                                           "(each step runs whole microbatches on every data-parallel replica). Fix: "
                                           "give a multiple of 4, e.g. --global-batch 8"),
    (["--margin", "1.5"], "--margin: 1.5 is not a share"),
    (["--gpu-memory", "80"], "--gpu-memory: 80 has no unit. Fix: write 80GiB or 80GB"),
    (["--gpu", "a100"], "mbx plan: --gpu: 'a100' is not a GPU preset (h100, h200, b200, b300, gb200, gb300). Fix: "
                        "give one of them, e.g. --gpu h100"),
    (["--gpu", "h200", "--gpu-ib", "-5"], "--gpu-ib: -5.0 is not a positive rate. Fix: give e.g. --gpu-ib 50"),
    (["--search"], "--gpus: --search looks for the best layout on a number of GPUs, and none was given. Fix: give "
                   "--gpus N, the GPUs the run will have (e.g. --gpus 16)"),
]


def _refused_without_torch(config: str, argv: list[str]) -> str:
    """``mbx plan --hf-config config ... argv`` in a fresh interpreter: exit 2, nothing on stdout, one ``mbx plan: ``
    line on stderr (returned), and torch never imported."""
    argv = ["--hf-config", config, "--seq", "8192", "--gpu-memory", "80GiB", *argv]
    code = ("import sys; from megatron_bridge_ext import cli; rc = cli.main(['plan', *sys.argv[1:]]); "
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr); "
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    line, imported = done.stderr.splitlines()
    assert line.startswith("mbx plan: "), line
    assert imported == "torch not imported"
    return line


@pytest.mark.parametrize("argv, expected", FAST_REFUSALS, ids=[" ".join(a) for a, _ in FAST_REFUSALS])
def test_numbers_and_the_hf_layout_are_refused_before_torch_is_imported(argv, expected):
    """Each refusal comes from the arguments and config.json alone, in a fresh interpreter that never imports torch."""
    line = _refused_without_torch(QWEN3_8B, argv)
    assert expected in line


def test_hf_config_needs_seq_unless_an_override_sets_it(capsys):
    """config.json's max_position_embeddings (40960 for Qwen3-8B) is no training length: --seq is required."""
    line = _one_line_error(capsys, ["--hf-config", QWEN3_8B, "--gpu-memory", "80GiB"])
    assert line == ("mbx plan: --seq: required with --hf-config (config.json's max_position_embeddings is the longest "
                    "sequence the model takes, not the training length). Fix: give the training length, e.g. --seq 4096")
    args = cli.build_parser().parse_args(["plan", "--hf-config", QWEN3_8B, "--gpu-memory", "80GiB",
                                          "model.seq_length=4096"])
    assert plan_cli.check_args(args) is None and args.gpu_memory == 80 * 2**30


def test_the_early_layout_check_says_what_the_estimate_says():
    """The check before the build words its refusals as the estimate's parallel_problems does on the built model."""
    from megatron_bridge_ext.estimate.memory import parallel_problems

    model = SimpleNamespace(tensor_model_parallel_size=3, pipeline_model_parallel_size=5, context_parallel_size=1,
                            seq_length=8192, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=None,
                            vocab_size=None, sequence_parallel=True, num_layers=36, num_layers_in_first_pipeline_stage=None,
                            num_layers_in_last_pipeline_stage=None, virtual_pipeline_model_parallel_size=None)
    late = [f.text() for f in parallel_problems(model, micro_batch=1)]
    for argv in (["--tp", "3", "--seq", "8192"], ["--tp", "3", "--seq", "8193"], ["--pp", "5", "--seq", "8192"]):
        args = cli.build_parser().parse_args(["plan", "--hf-config", QWEN3_8B, "--gpu-memory", "80GiB", *argv])
        assert plan_cli.check_args(args) in late, argv


@pytest.mark.parametrize("command", ["plan", "diagnose", "env", "run", "patches", "demo", "bench memory"])
def test_every_subcommand_help_ends_with_two_examples(command):
    done = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", *command.split(), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    examples = done.stdout.split("\nexamples:\n")[1].splitlines()
    assert len([line for line in examples if line.startswith(f"  mbx {command} ")
                or line.strip() == f"mbx {command}" or line.startswith(f"  mbx {command}  ")]) == 2, examples


def test_every_optional_plan_option_states_its_default():
    parser = cli.build_parser()
    plan_parser = next(a for a in parser._actions if a.dest == "command").choices["plan"]
    required_group = {a.dest for g in plan_parser._mutually_exclusive_groups if g.required for a in g._group_actions}
    for action in plan_parser._actions:
        if action.option_strings and not action.required and action.dest not in required_group | {"help"}:
            assert "default" in (action.help or ""), action.option_strings


def test_the_config_line_says_full_fine_tuning_is_the_default():
    settings = gpt_stage(tp=1, pp=1, vpp=None, dp=1, sequence_parallel=False, seq_length=4096, micro_batch=1,
                         num_microbatches=1, dtype="bfloat16", peft=None, recompute_granularity=None,
                         attention="fused", transformer_impl="transformer_engine")
    line = render_plan.settings_line(settings, peft_defaulted=True)
    assert "no PEFT: every parameter trained (the default; --peft lora for LoRA)" in line
    assert "the default" not in render_plan.settings_line(settings)


def small_plan(*, gpu_memory: int, sequence_parallel_input_strategy: str = "off"):
    """A plan of the demo's tiny GPT (TP 2, SP, LoRA) on a device of ``gpu_memory`` bytes."""
    from megatron_bridge_ext import planner
    from megatron_bridge_ext.peft import LoRA
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=2, hidden=64, ffn=256, heads=8, kv_heads=4, seq=512, micro_batch=1, vocab=128, tp=2,
                         dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, LoRA(target_modules=list(shape.lora_targets), dim=shape.lora_rank, alpha=16,
                                  sequence_parallel_input_strategy=sequence_parallel_input_strategy))
    cfg.data_parallel_size, cfg.train.global_batch_size = 2, 2
    return planner.plan(cfg, gpu_memory=gpu_memory, expandable_segments=False)


def test_why_an_option_does_not_apply_goes_below_a_narrow_table():
    """LoRA-A already shard_local: step 2 is n/a, and its reason is a note under the table, not a table cell."""
    text = plan_cli.format_plan(small_plan(gpu_memory=1, sequence_parallel_input_strategy="shard_local"))
    table, notes = text.split("  step  option")[1].split("why not, constraints")
    assert all(len(line) <= 120 for line in table.splitlines()), table
    assert "already shard_local" not in table
    assert "  - step 2 sequence_parallel_input_strategy=shard_local: n/a: already shard_local" in notes.splitlines()


@pytest.mark.parametrize("label", ["recompute_modules=['core_attn', 'mlp']", "offload 35 of 36 layers (no recompute)",
                                   "sequence_parallel_input_strategy=shard_local"])
def test_plot_labels_wrap_between_words_only(label):
    assert plan_plot.tick_label(label).split() == label.split()


def test_config_json_missing_fields_is_one_line(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 128}))
    line = _one_line_error(capsys, ["--hf-config", str(path), "--gpu-memory", "80GiB"])
    assert "lacks num_attention_heads, num_hidden_layers" in line


def test_a_multimodal_config_json_is_read_from_its_text_config(capsys, tmp_path):
    """Bridge's multimodal bridges build the language model from ``text_config``: the shape checks read it there
    (its 3 query groups are not divisible by TP 2, a check that needs the nested fields)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_vl", "text_config": {
        "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 6, "num_key_value_heads": 3,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 128}}))
    line = _one_line_error(capsys, ["--hf-config", str(path), "--gpu-memory", "80GiB", "--seq", "64", "--tp", "2"])
    assert "TP=2 neither divides the 3 query groups nor is a multiple of them" in line
    path.write_text(json.dumps({"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3", "hidden_size": 64}}))
    line = _one_line_error(capsys, ["--hf-config", str(path), "--gpu-memory", "80GiB", "--seq", "64"])
    assert "lacks num_attention_heads, vocab_size, num_hidden_layers (nor does its text_config)" in line


def test_plot_without_matplotlib_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(plan_cli, "_have_matplotlib", lambda: False)
    line = _one_line_error(capsys, ["--hf-config", QWEN3_8B, "--seq", "4096", "--gpu-memory", "80GiB", "--plot",
                                    str(tmp_path / "x.png")])
    assert 'pip install "megatron-bridge-ext[plot]"' in line


def test_qwen3_8b_lora_json(capsys):
    """Qwen3-8B, Bridge's LoRA (dim 32, its default) on the four linears, TP 2 x DP 4, sequence 8192: the static
    components from config.json by hand, the LoRA inputs and the TE shards from their shapes, the peak their sum
    with the largest transient, and the 10% margin of an 80 GB device."""
    argv = ["plan", "--hf-config", QWEN3_8B, "--tp", "2", "--seq", "8192", "--peft", "lora", "--dp", "4",
            "--gpu-memory", "80GB", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    settings = report["estimate"]["settings"]
    assert (settings["tp"], settings["sequence_parallel"], settings["seq_length"], settings["dp"]) == (2, True, 8192, 4)
    assert settings["peft"].endswith("LoRA") and settings["sequence_parallel_input_strategy"] == "off"
    assert report["fits_as_is"] is True and report["options"] == []
    assert report["margin"] == 0.10 and report["usable_now"] == 72_000_000_000  # 80e9 B less 10%
    hf = json.loads(Path(QWEN3_8B).read_text())
    tp, rank, s, h, layers = 2, 32, 8192, hf["hidden_size"], hf["num_hidden_layers"]
    adapters = layers * adapter_params(hf, tp, rank)
    components = {c["name"]: c["bytes"] for c in report["estimate"]["components"]}
    assert components["weights: embedding"] == components["weights: output layer"] == hf["vocab_size"] // tp * h * 2
    assert components["weights: transformer layers"] == (layers * layer_params(hf, tp) + h) * 2
    assert components["weights: adapters"] == adapters * 2
    assert components["gradients (main_grad buffer)"] == adapters * 4  # bf16_mixed: fp32 main_grad, adapters only
    assert components["optimizer states"] == -(-adapters * 12 // 4)  # distributed Adam over DP 4
    # Bridge's path: LoRA-A of qkv and fc1 keep the gathered [s, 1, h] input, fc2's its [s, 1, ffn/t], each
    # LoRA-B its [s, 1, r]; TE's LayerNormLinear keeps its [s/t, 1, h] shard beside each gathered copy.
    ffn = hf["intermediate_size"]
    assert components["lora inputs"] == layers * (2 * s * h + s * ffn // tp + 4 * s * rank) * 2
    assert components["TE norm-output shards (contract)"] == 2 * layers * (s // tp) * h * 2
    kinds = {}
    for c in report["estimate"]["components"]:
        kinds.setdefault(c["kind"], []).append(c["bytes"])
    assert report["estimate"]["peak_bytes"] == (sum(kinds["static"]) + sum(kinds["activations"])
                                                + sum(kinds.get("buffers", [])) + max(kinds["transient"]))
    # Bridge's own estimate charges the frozen base with gradients and optimizer states.
    assert report["bridge_estimate"]["total_bytes"] > report["estimate"]["peak_bytes"]
    assert "answer" in report and "chosen" not in report  # the text's word for it


def test_text_output_walks_the_levers_and_answers(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "plan.png"
    argv = ["plan", "--hf-config", LLAMA3_8B, "--tp", "2", "--seq", "8192", "--peft", "lora", "--dp", "2",
            "--gpu-memory", "4GB", "--plot", str(plot), "model.num_layers=2"]
    assert cli.main(argv) == 0
    text, err = capsys.readouterr()
    assert f"mbx plan: plot written to {plot}" in err.splitlines()
    order = ["per-rank estimate", "Bridge's estimate_training_memory", "does not fit as is",
             "levers, in the decision order", "answer:", "assumptions:"]
    positions = [text.index(marker) for marker in order]
    assert positions == sorted(positions)
    steps = [line.split()[0] for line in text[positions[3]:positions[4]].splitlines()[3:] if line[:3].strip().isdigit()]
    assert steps == sorted(steps, key=int) and steps[:2] == ["1", "2"]
    # 4 GB less the 10% margin as is, less the 3% margin kept with expandable segments on at every step
    assert f"usable {4e9 * (1 - planner.MARGIN) / 2**30:.2f} GiB after a 10% margin" in text
    usable = f"{4e9 * (1 - planner.EXPANDABLE_MARGIN) / 2**30:.2f} GiB"
    [tp_row] = [line for line in text.splitlines() if "TP 2 -> 4, DP 2 -> 1" in line and line.lstrip().startswith("4")]
    assert usable in tp_row and " yes " in tp_row
    # Steps 1 to 3 each lower the peak, and only TP 2 -> 4 (half of every shard) on top of them fits; the answer is
    # TP 2 -> 4 without the mlp recompute the walk carried (it is not needed there) and faster than the walk's option.
    [answer] = [line for line in text.splitlines() if line.startswith("answer: ")]
    assert answer.startswith("answer: the fastest fitting combination of the levers (TP 2->4, DP 2->1, "
                             "sequence_parallel_input_strategy shard_local)")
    assert float(answer.split("step time ")[1].rstrip("%")) < float(re.search(r"\s([+-][\d.]+)%\s", tp_row).group(1))
    assert "MemoryConfig(expandable_segments=False, sequence_parallel_input_strategy='shard_local')" in text
    assert "model.tensor_model_parallel_size=4" in text and "no combination of the levers fits" not in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------
# Recipes, overrides and the answer pasted back

WITH_LORA = "tests.support.plan_recipes:vanilla_gpt_with_lora"
VANILLA = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"
QWEN3_RECIPE = "megatron.bridge.recipes.qwen.qwen3:qwen3_8b_peft_config"
TINY = ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_attention_heads=8",
        "model.vocab_size=1024", "model.share_embeddings_and_output_weights=false"]
OUR_LORA = ["+peft._target_=megatron_bridge_ext.peft.LoRA", "+peft.sequence_parallel_input_strategy=shard_local"]


def _json_plan(capsys, *argv) -> dict:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_answer_pasted_into_a_run_of_a_recipe_that_sets_peft_switches_its_lora(capsys):
    """Every option that turns on the LoRA input strategy, taken as printed (overrides through Bridge's own
    parser on the recipe, then the MemoryConfig line where the option gives one), gives our LoRA with that
    strategy and the recompute fields MemoryConfig.apply sets."""
    pytest.importorskip("hydra", reason="Bridge's override parser needs hydra-core")
    from megatron_bridge_ext.config import MemoryConfig
    from megatron_bridge_ext.peft import LoRA  # first: it imports Bridge's PEFT modules (without TE, by a hook)
    from tests.support import plan_recipes

    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    run = TINY + ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", "model.seq_length=1024"]
    report = _json_plan(capsys, "--recipe", WITH_LORA, "--tp", "2", "--sp", "--seq", "1024", "--dp", "1", "--gpu-memory", "1MB",
                        *TINY)
    switching = [o for o in report["options"] if o["applicable"] and o["memory_config"].get("sequence_parallel_input_strategy")]
    assert switching
    for option in switching:
        flags = MemoryConfig(**option["memory_config"])
        pasted = process_config_with_overrides(plan_recipes.vanilla_gpt_with_lora(),
                                               cli_overrides=run + option["overrides"])
        if option.get("peft_note"):
            assert "MemoryConfig(" in option["peft_note"] and ").apply(cfg)" in option["peft_note"]
            flags.apply(pasted)
        expected = process_config_with_overrides(plan_recipes.vanilla_gpt_with_lora(), cli_overrides=run)
        flags.apply(expected)
        assert type(pasted.peft) is LoRA, option["overrides"]
        assert pasted.peft.strategy_in_effect == option["memory_config"]["sequence_parallel_input_strategy"]
        assert pasted.peft.dim == plan_recipes.LORA_DIM  # the recipe's own PEFT, switched, not replaced
        for name in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"):
            assert getattr(pasted.model, name) == getattr(expected.model, name), name


def test_peft_flag_with_the_strategy_overrides_traces_the_strategy(capsys):
    report = _json_plan(capsys, "--recipe", VANILLA, "--tp", "2", "--seq", "1024", "--dp", "1", "--peft", "lora", "--gpu-memory",
                        "80GB", *TINY, *OUR_LORA)
    settings = report["estimate"]["settings"]
    assert settings["sequence_parallel_input_strategy"] == "shard_local" and settings["lora_dim"] == 32  # --lora-dim's default


@pytest.mark.parametrize("override", ["model.num_layerz=32", "+model.num_layerz=32", "++model.num_layerz=32"])
def test_a_misspelt_field_is_named_with_the_closest_one(capsys, override):
    line = _one_line_error(capsys, ["--recipe", VANILLA, "--gpu-memory", "80GB", override])
    assert line == "mbx plan: model.num_layerz: no such field of GPTModelProvider. Fix: did you mean model.num_layers?"


def test_a_misspelt_strategy_in_an_override_stops_the_plan(capsys):
    line = _one_line_error(capsys, ["--recipe", VANILLA, "--gpu-memory", "80GB", *TINY,
                                    "+peft._target_=megatron_bridge_ext.peft.LoRA",
                                    "+peft.sequence_parallel_input_strategy=shard_lcoal"])
    assert line.startswith("mbx plan: peft.sequence_parallel_input_strategy: 'shard_lcoal' is not valid")
    assert "Fix: use one of 'off', 'regather', 'shard_local'" in line and "(did you mean 'shard_local'?)" in line


def test_a_misspelt_peft_field_names_the_class_and_the_closest_field(capsys):
    line = _one_line_error(capsys, ["--recipe", VANILLA, "--gpu-memory", "80GB",
                                    "+peft._target_=megatron_bridge_ext.peft.LoRA",
                                    "+peft.sequence_parallel_input_stategy=shard_local"])
    assert "peft.sequence_parallel_input_stategy: no such field of megatron_bridge_ext.peft.lora.LoRA" in line
    assert line.endswith("Fix: did you mean peft.sequence_parallel_input_strategy?")


def test_peft_overrides_on_a_recipe_that_sets_peft_are_refused_not_ignored(capsys):
    line = _one_line_error(capsys, ["--recipe", WITH_LORA, "--gpu-memory", "80GB", *OUR_LORA])
    assert line.startswith("mbx plan: peft: +peft._target_=megatron_bridge_ext.peft.LoRA changes nothing: cfg.peft is "
                           "a LoRA object set in Python")
    assert "MemoryConfig(sequence_parallel_input_strategy=...).apply(cfg)" in line


def test_a_peft_field_override_on_a_recipe_that_sets_peft_names_the_field_not_the_strategy(capsys):
    """``++peft.dim=64`` on a LoRA recipe: the fix is where to set the dim, not our LoRA-A input strategy."""
    line = _one_line_error(capsys, ["--recipe", WITH_LORA, "--gpu-memory", "80GB", "++peft.dim=64"])
    assert line.startswith("mbx plan: peft: ++peft.dim=64 changes nothing: cfg.peft is a LoRA object set in Python")
    assert "set cfg.peft.dim in the training script" in line and "sequence_parallel_input_strategy" not in line


def test_neither_recipe_nor_config_json_is_one_line(capsys):
    assert "--recipe MODULE:FUNCTION or --hf-config FILE" in _one_line_error(capsys, ["--gpu-memory", "80GB"])


@pytest.mark.parametrize("sp, expected", [([], True), (["--no-sp"], False)])
def test_tp_on_a_recipe_turns_sequence_parallelism_on_as_with_a_config_json(capsys, sp, expected):
    argv = ["plan", "--recipe", VANILLA, "--tp", "2", "--seq", "1024", "--dp", "1", *sp, "--gpu-memory", "80GB", *TINY]
    assert cli.main(argv) == 0
    config_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("config: "))
    assert ("SP=on" in config_line) is expected
    assert ("SP on: the default with TP > 1 (--no-sp turns it off)" in config_line) is expected


@pytest.fixture
def no_network(monkeypatch):
    """Any TCP connection fails at once, as on a machine without the hub; the attempts are recorded."""
    import socket

    attempts = []

    def refuse(address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"no network in this test ({address})")

    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def test_a_bridge_model_recipe_plans_offline_from_a_local_config_json(capsys, tmp_path, no_network):
    """qwen3_8b_peft_config reads Qwen/Qwen3-8B's config from the hub; --hf-config answers that read."""
    data = json.loads(open(QWEN3_8B).read())
    data["num_hidden_layers"] = 3  # not the hub's 36: the layers come from this file
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    report = _json_plan(capsys, "--recipe", QWEN3_RECIPE, "--hf-config", str(path), "--tp", "2", "--gpus", "2",
                        "--seq", "1024", "--gpu-memory", "200GB")
    settings = report["estimate"]["settings"]
    assert (settings["num_layers"], settings["hidden"]) == (3, data["hidden_size"])
    assert settings["tp"] == 2 and settings["sequence_parallel"] is True  # the recipe's SP=False follows --tp 2
    assert settings["lora_dim"] == 8  # the recipe's own LoRA
    assert no_network == []


def test_an_unreachable_hub_fails_after_one_cache_lookup(capsys, monkeypatch):
    """Offline, Bridge's config read is tried once from the local cache, not 4 times with network retries."""
    from huggingface_hub import constants
    from transformers import AutoConfig

    calls = []

    def from_pretrained(cls, path, *args, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        raise OSError(f"{path} is not in the local cache")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(from_pretrained))
    line = _one_line_error(capsys, ["--recipe", QWEN3_RECIPE, "--gpu-memory", "80GB"])
    assert calls == [True]
    assert ("reads Qwen/Qwen3-8B's config from the Hugging Face hub, which is not reachable (HF_HUB_OFFLINE is set)"
            in line)
    assert "Fix: add --hf-config with the model's config.json" in line


def test_an_override_bridges_parser_skips_with_a_warning_is_refused(capsys):
    """cfg.ft is None: Bridge cannot build the _target_, logs it, keeps a dict and goes on; the plan stops."""
    line = _one_line_error(capsys, ["--recipe", VANILLA, "--gpu-memory", "80GB", "+ft._target_=no_such_module.Config"])
    assert line.startswith("mbx plan: overrides: Bridge's override parser did not apply everything: Failed to "
                           "instantiate ft from _target_")
    assert line.endswith("Fix: correct that override")


# ------------------------------------------------------------------------------------------------
# The plan's own imports (patches bridge_plan_without_diffusion, core_training_plan_without_modelopt)

LEFT_OUT = ["megatron.bridge.diffusion.models", "modelopt"]
"""What the plan's import patches keep out of its process."""

_PLAN_IN_A_FRESH_PROCESS = """
import contextlib, io
from megatron_bridge_ext import cli
from megatron_bridge_ext.patches import registry

if not LEAN:
    registry.PLAN_IMPORTS = ()
out = io.StringIO()
with contextlib.redirect_stdout(out):
    status = cli.main(["plan", *ARGV, "--json"])
report(status=status, plan=json.loads(out.getvalue()), imported=[name for name in LEFT_OUT if name in sys.modules],
       hooks=[p.applied for p in registry.PATCHES])
"""


def _without_seconds(value):
    """The plan's JSON less the estimate's run time (the one field two runs do not share)."""
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


@pytest.mark.parametrize("argv", [
    ["--hf-config", QWEN3_8B, "--tp", "2", "--seq", "8192", "--peft", "lora", "--dp", "4", "--gpu-memory", "40GB"],
    ["--recipe", WITH_LORA, "--tp", "2", "--sp", "--seq", "1024", "--dp", "1", "--gpu-memory", "1MB", *TINY],
], ids=["readme-qwen3-8b", "recipe-with-lora"])
def test_the_plan_is_the_same_without_the_imports_it_leaves_out(argv):
    """The README's example and a recipe, each planned in a fresh interpreter with the plan's import patches and
    without them: the same plan, and only the patched run kept the diffusion bridges and ModelOpt out."""
    from tests.support.fresh import run

    runs = {lean: run(f"LEAN, ARGV, LEFT_OUT = {lean!r}, {argv!r}, {LEFT_OUT!r}", _PLAN_IN_A_FRESH_PROCESS)
            for lean in (True, False)}
    assert [runs[lean]["status"] for lean in (True, False)] == [0, 0]
    assert runs[True]["imported"] == [] and runs[False]["imported"] == LEFT_OUT
    assert not any(runs[True]["hooks"])  # removed after the plan
    assert runs[True]["plan"]["options"]  # a plan with levers, not two empty ones
    assert _without_seconds(runs[True]["plan"]) == _without_seconds(runs[False]["plan"])


# ------------------------------------------------------------------------------------------------
# Mixture-of-experts models: --ep/--etp checked before the build; our estimate beside Bridge's, and Bridge's
# figure alone where ours refuses (token dropping)

QWEN3_30B_A3B = os.path.join(DATA, "qwen3-30b-a3b", "config.json")
GPT_OSS_120B = os.path.join(DATA, "gpt-oss-120b", "config.json")

EXPERT_REFUSALS = [
    (QWEN3_30B_A3B, ["--ep", "0"], "--ep: 0 is not a whole number of 1 or more. Fix: give e.g. --ep 4"),
    (QWEN3_30B_A3B, ["--etp", "-1"], "--etp: -1 is not a whole number of 1 or more. Fix: give e.g. --etp 1"),
    (QWEN3_30B_A3B, ["model.expert_model_parallel_size=0"],
     "model.expert_model_parallel_size: 0 is not a whole number of 1 or more. Fix: give e.g. "
     "model.expert_model_parallel_size=4"),
    # 128 experts: 3 does not divide them; the largest EP up to 3 that does is 2
    (QWEN3_30B_A3B, ["--tp", "4", "--ep", "3", "--dp", "4"],
     "--ep: EP=3 does not divide the 128 experts (each EP rank holds a whole share). Fix: choose an EP that divides "
     "128, e.g. --ep 2"),
    (QWEN3_8B, ["--ep", "2", "--dp", "2"], "--ep: EP=2 needs a mixture-of-experts model, and this one has no experts. "
                                            "Fix: drop --ep (or set it to 1)"),
    # TP 4 x DP 1 = 4 GPUs per stage, ETP 4 x EP 4 = 16: DP must be a multiple of 16 / gcd(4, 16) = 4
    (QWEN3_30B_A3B, ["--tp", "4", "--ep", "4", "--etp", "4"],
     "--dp: TP x CP x DP = 4 x 1 x 1 = 4 is not a multiple of ETP x EP = 4 x 4 = 16"),
    # an unset ETP is 1 with EP > 1 (Bridge's finalize): 2 GPUs per stage, a grid of 1 x 8
    (QWEN3_30B_A3B, ["--tp", "2", "--ep", "8"],
     "--dp: TP x CP x DP = 2 x 1 x 1 = 2 is not a multiple of ETP x EP = 1 x 8 = 8 (each pipeline stage's GPUs must "
     "split into whole expert-parallel groups; ETP=1 (the default with EP>1)). Fix: make DP a multiple of 4, e.g. "
     "--dp 4, or choose a smaller EP or ETP"),
    # ETP 1: 2 x 1 x 1 = 2 GPUs, 1 x 4 = 4: DP a multiple of 4 / gcd(2, 4) = 2
    (QWEN3_30B_A3B, ["--tp", "2", "--ep", "4", "--etp", "1"], "Fix: make DP a multiple of 2, e.g. --dp 2"),
    # an override's EP counts, and CP: 2 x 2 x 2 = 8 is not a multiple of 2 x 8 = 16
    (QWEN3_30B_A3B, ["--tp", "2", "--dp", "2", "--etp", "2", "model.expert_model_parallel_size=8",
                     "model.context_parallel_size=2"], "= 2 x 2 x 2 = 8 is not a multiple of ETP x EP = 2 x 8 = 16"),
]


@pytest.mark.parametrize("config, argv, expected", EXPERT_REFUSALS,
                         ids=[" ".join(a) for _, a, _ in EXPERT_REFUSALS])
def test_expert_sizes_core_refuses_are_refused_before_torch_is_imported(config, argv, expected):
    """Megatron Core's expert-parallel rules, one line each from the arguments and config.json, torch never imported."""
    line = _refused_without_torch(config, argv)
    assert expected in line and ". Fix: " in line, line


def test_gpt_oss_builds_offline_and_its_biased_experts_need_etp_1(capsys, no_network):
    """GPT-OSS's provider (built from the local config.json, no hub) has biased linear layers: ETP, which is TP without
    EP, must be 1 there (Megatron Core's TransformerConfig), which only the built model tells."""
    line = _one_line_error(capsys, ["--hf-config", GPT_OSS_120B, "--tp", "4", "--dp", "4", "--seq", "8192",
                                    "--gpu-memory", "80GB"])
    assert line == ("mbx plan: --etp: ETP=4 (the default with EP=1) with biased linear layers (model.add_bias_linear): "
                    "Megatron Core supports MoE bias only with ETP=1. Fix: set --etp 1")
    assert no_network == []


MOE_ARGV = ["--hf-config", QWEN3_30B_A3B, "--tp", "4", "--seq", "8192", "--peft", "lora", "--gpu-memory", "80GB"]


def _moe_plan(capsys, *argv) -> tuple[int, str]:
    status = cli.main(["plan", *MOE_ARGV, *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out


def _row(lines: list[str], name: str, nbytes: int, basis: str) -> bool:
    """A line of the estimate's table naming ``name`` with ``nbytes`` in GiB and ``basis``."""
    return any(f" {name} " in line and f"{nbytes / 2**30:,.2f} GiB" in line and basis in line for line in lines)


DROPPING = ["model.moe_expert_capacity_factor=1.0", "model.moe_token_dispatcher_type=flex",
            "model.moe_flex_dispatcher_backend=deepep"]
"""Token dropping on DeepEP: an MoE setting our estimate does not model (Bridge's formula reads the config
regardless)."""


def test_a_moe_plan_prints_our_table_beside_bridges_with_the_expert_load_stated(capsys):
    status, text = _moe_plan(capsys, "--ep", "4", "--dp", "4")
    assert status == 0
    lines = text.splitlines()
    [config] = [line for line in lines if line.startswith("config: ")]
    assert config.startswith("config: TP=4 PP=1 EP=4 ETP=1 DP=4 SP=on, seq 8192")
    assert ("128 experts (top-8, 32 on this rank, alltoall dispatcher), expert load 1.0 (balanced, the default; "
            "--moe-imbalance sets the most loaded expert's share)") in config
    for row in ("weights: experts", "weights: expert adapters", "moe dispatch", "experts  "):
        assert any(row in line for line in lines), row
    # By hand from config.json: 128 experts / EP 4 = 32 on the rank, unsharded (ETP 1), on 48 layers; each expert
    # fc1 (h -> 2 x moe_ffn, SwiGLU) and fc2 (moe_ffn -> h), frozen; Bridge's LoRA (dim 32) on both, trainable.
    hf = json.loads(Path(QWEN3_30B_A3B).read_text())
    h, moe_ffn, layers, r = hf["hidden_size"], hf["moe_intermediate_size"], hf["num_hidden_layers"], 32
    local = layers * hf["num_experts"] // 4
    experts = local * 3 * h * moe_ffn
    expert_adapters = local * r * ((h + 2 * moe_ffn) + (moe_ffn + h))
    # attention adapters over TP 4: qkv r x (h + (n + 2g) d), proj r x (n d + h)
    n, g, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    dense = layers * r * ((h + (n + 2 * g) * d) + (n * d + h)) // 4
    assert _row(lines, "weights: experts", experts * 2, f"{experts:,} frozen parameters x 2 B")
    assert _row(lines, "weights: expert adapters", expert_adapters * 2, f"{expert_adapters:,} trainable parameters")
    # Adam's 12 B: dense over DP 4, experts over expert DP = DP 4 x TP 4 / (EP 4 x ETP 1) = 4
    assert _row(lines, "optimizer states", dense * 12 // 4 + expert_adapters * 12 // 4,
                f"{dense:,} trainable parameters x adam")
    assert f"{expert_adapters:,} trainable expert parameters x 12 B, distributed over expert DP" in text
    assert "Bridge's estimate_training_memory for the same config, per rank" in text
    assert "routed expert parameters and optimizer" in text and "Bridge minus ours: " in text
    assert "fits as is" in text and "our estimate: not modelled" not in text
    assert any("MoE routing: a stated load" in line for line in lines)


def test_a_moe_plan_with_token_dropping_shows_bridges_figure_and_our_refusal_in_one_line(capsys):
    status, text = _moe_plan(capsys, "--ep", "4", "--dp", "4", *DROPPING)
    assert status == plan_cli.NOT_MODELLED_STATUS
    refusals = [line for line in text.splitlines() if line.startswith("our estimate: ")]
    assert refusals == ["our estimate: not modelled: model.moe_expert_capacity_factor: token dropping on the flex "
                        "dispatcher is not modelled by the estimate unless HybridEP pads to capacity (its kernels "
                        "count the capped tokens, which the stand-ins state dropless). Fix: estimate with "
                        "model.moe_pad_expert_input_to_capacity=true on HybridEP, or on Core's all-to-all dispatcher "
                        "(model.moe_token_dispatcher_type=alltoall)"]
    assert "Bridge's estimate_training_memory for the same config, per rank" in text
    assert "config: TP=4 PP=1 CP=1 EP=4 ETP=1 DP=4 SP=on, seq 8192, micro-batch 1, 128 experts (top-8)" in text
    assert "fits: no verdict" in text and "fits as is" not in text and "answer:" not in text


def test_the_moe_json_carries_both_estimates_per_rank(capsys):
    """Both figures are per rank: EP=4 holds half the experts EP=2 holds (128/4 against 128/2), in Bridge's
    routed-expert share and in our expert weights.

    DP grows with EP so that the experts' own DP (GPUs / (ETP x EP)) stays 1: their optimizer states are
    sharded the same way in both runs."""
    reports = {}
    for ep in (2, 4):
        status, out = _moe_plan(capsys, "--ep", str(ep), "--dp", str(ep), "--json")
        assert status == 0
        reports[ep] = json.loads(out)
    report = reports[4]
    assert report["estimate_refused"] in (None, []) and report["bridge_estimate_error"] is None
    assert report["layout"]["ep"] == 4 and report["layout"]["num_moe_experts"] == 128
    bridge = {ep: dict((c["name"], c["bytes"]) for c in reports[ep]["bridge_estimate"]["components"])
              ["routed expert parameters and optimizer"] for ep in reports}
    ours = {ep: {c["name"]: c["bytes"] for c in reports[ep]["estimate"]["components"]}["weights: experts"]
            for ep in reports}
    assert bridge[2] == 2 * bridge[4] and ours[2] == 2 * ours[4]


def test_a_moe_imbalance_below_1_is_refused_before_torch_is_imported():
    line = _refused_without_torch(QWEN3_30B_A3B, ["--tp", "4", "--ep", "4", "--dp", "4", "--moe-imbalance", "0.9"])
    assert line.startswith("mbx plan: --moe-imbalance: 0.9 is not a load factor of 1 or more") and ". Fix: " in line, line


def _bridge_fails(monkeypatch):
    from megatron_bridge_ext.estimate import bridge

    def fail(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for *: 'NoneType' and 'int'\nsecond line")

    monkeypatch.setattr(bridge, "bridge_estimate", fail)


FAILED = "Bridge's estimate_training_memory failed: TypeError: unsupported operand type(s) for *: 'NoneType' and 'int'"


def test_a_failing_bridge_estimate_is_one_line_and_our_plan_stands(monkeypatch):
    _bridge_fails(monkeypatch)
    result = small_plan(gpu_memory=1)
    text = plan_cli.format_plan(result)
    assert [line for line in text.splitlines() if "estimate_training_memory" in line] == [FAILED]
    assert "does not fit as is" in text and "answer:" in text  # the rest of the plan stands
    report = result.as_dict()
    assert report["bridge_estimate"] is None and report["bridge_estimate_error"] == FAILED.split("failed: ")[1]
    assert report["estimate"]["peak_bytes"] > 0


def test_a_moe_plan_whose_bridge_estimate_fails_says_both_in_a_line_each(capsys, monkeypatch):
    _bridge_fails(monkeypatch)
    status, text = _moe_plan(capsys, "--ep", "4", "--dp", "4", *DROPPING)
    assert status == plan_cli.NOT_MODELLED_STATUS
    assert FAILED in text.splitlines()
    assert len([line for line in text.splitlines() if line.startswith("our estimate: not modelled: ")]) == 1
    assert "component" not in text  # no table at all


def test_an_unset_expert_tp_is_1_with_ep_as_bridge_finalizes_it(capsys):
    """Bridge's finalize sets an unset ETP to 1 when EP > 1 (not Megatron Core's TP): the layout the plan prints and
    checks is that one, and Bridge's figure for it is the figure of --etp 1, not of --etp 4."""
    reports = {}
    for etp in ([], ["--etp", "1"], ["--etp", "4"]):
        status, out = _moe_plan(capsys, "--ep", "4", "--dp", "4", "--json", *etp)
        assert status == 0
        reports[tuple(etp)] = json.loads(out)
    assert [reports[k]["layout"]["etp"] for k in reports] == [1, 1, 4]
    figures = [reports[k]["bridge_estimate"]["total_bytes"] for k in reports]
    assert figures[0] == figures[1] != figures[2]


def test_a_recipes_expert_layout_is_checked_once_built(capsys):
    """Without --hf-config the experts are known only once the recipe is built: the same rule, naming the field."""
    line = _one_line_error(capsys, ["--recipe", VANILLA, "--gpu-memory", "80GB", *TINY, "model.num_moe_experts=4",
                                    "model.expert_model_parallel_size=3"])
    assert line == ("mbx plan: model.expert_model_parallel_size: EP=3 does not divide the 4 experts (each EP rank holds "
                    "a whole share). Fix: choose an EP that divides 4, e.g. model.expert_model_parallel_size=2")


def test_a_moe_plan_writes_no_plot_and_says_so(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    status = cli.main(["plan", *MOE_ARGV, "--ep", "4", "--dp", "4", "--plot", str(path), *DROPPING])
    err = capsys.readouterr().err
    assert status == plan_cli.NOT_MODELLED_STATUS and not path.exists()
    assert f"mbx plan: no plot written to {path}: its bars are our estimate's" in err


def test_the_plan_states_the_device_and_prints_each_options_step_time():
    """The default device is named as the default; every applicable option has a signed percentage in the table
    (its config's step time against the config as is), n/a options a dash, and the JSON carries the same."""
    result = small_plan(gpu_memory=1)
    text = plan_cli.format_plan(result)
    words = " ".join(text.split())  # the line wraps at 120 columns
    assert ("step time (calibrated on published throughput, h100: 989.5 TFLOP/s dense bf16 at a GEMM efficiency by "
            "size") in words
    assert "the default, --gpu h200|b200|b300|gb200|gb300 to change" in words
    assert "--gpu h200|b200" not in " ".join(plan_cli.format_plan(result, gpu_defaulted=False).split())
    header, _, *rows = text.split("\n  step  option")[1].split("\nwhy not")[0].splitlines()
    assert "time" in header.split()
    for option, row in zip(result.options, rows):
        cell = row.split()[-1 - len(option.cost.measured().split())]
        assert cell == (f"{option.cost.step_time_pct:+.1f}%" if option.applicable else "-"), row
    report = result.as_dict()
    assert report["gpu"]["name"] == "h100" and report["step_time_s"]["total"] == result.step_time.total
    assert [o["cost"]["step_time_pct"] is not None for o in report["options"]] == [o.applicable for o in result.options]


def test_gpu_flag_and_overrides_reach_the_device(capsys):
    args = cli.build_parser().parse_args(["plan", "--hf-config", QWEN3_8B, "--seq", "4096", "--gpu-memory", "80GiB",
                                          "--gpu", "b200", "--gpu-flops", "1000", "--gpu-nvlink", "300"])
    assert plan_cli.check_args(args) is None
    assert (args.device.name, args.device.bf16_flops, args.device.nvlink, args.device.hbm) == ("b200", 1e15, 3e11, 8e12)


# ------------------------------------------------------------------------------------------------
# The world size: --gpus, --dp, or the GPU count a recipe's name states; never DP 1 unsaid
# ------------------------------------------------------------------------------------------------

QWEN3_16GPU = "megatron.bridge.recipes.qwen.h100.qwen3:qwen3_8b_pretrain_16gpu_h100_bf16_config"


def _built(*argv):
    from megatron_bridge_ext.cli import build_parser
    from megatron_bridge_ext.plan_config import build_config

    args = build_parser().parse_args(["plan", *argv, "--gpu-memory", "80GiB"])
    assert plan_cli.check_args(args) is None
    return build_config(args)[0]


def test_a_recipe_runs_on_the_gpu_count_its_name_states_and_says_so():
    """qwen3_8b_pretrain_16gpu: 16 GPUs over the recipe's TP x PP x CP (read from its config) give DP."""
    built = _built("--recipe", QWEN3_16GPU, "--hf-config", QWEN3_8B)
    model = built.cfg.model
    per_replica = model.tensor_model_parallel_size * model.pipeline_model_parallel_size * model.context_parallel_size
    assert built.cfg.data_parallel_size == 16 // per_replica
    assert (f"16 GPUs (the GPU count qwen3_8b_pretrain_16gpu_h100_bf16_config's name states; --gpus N changes it): "
            f"DP = 16 / (TP x PP x CP = {model.tensor_model_parallel_size} x {model.pipeline_model_parallel_size} x "
            f"{model.context_parallel_size} = {per_replica}) = {16 // per_replica}") in built.notes


def test_gpus_sets_dp_for_a_config_json_and_a_recipe():
    built = _built("--hf-config", QWEN3_8B, "--seq", "4096", "--tp", "2", "--gpus", "8")
    assert built.cfg.data_parallel_size == 4 and built.cfg.train.global_batch_size == 4  # micro-batch 1 x DP 4 x PP 1
    assert "8 GPUs (--gpus): DP = 8 / (TP x PP x CP = 2 x 1 x 1 = 2) = 4" in built.notes
    built = _built("--recipe", QWEN3_16GPU, "--hf-config", QWEN3_8B, "--gpus", "32")
    model = built.cfg.model
    assert built.cfg.data_parallel_size == 32 // (model.tensor_model_parallel_size * model.pipeline_model_parallel_size
                                                  * model.context_parallel_size)


def test_dp_one_by_default_is_said_for_a_config_json():
    built = _built("--hf-config", QWEN3_8B, "--seq", "4096", "--tp", "2")
    assert built.cfg.data_parallel_size == 1
    assert "2 GPUs: DP 1 (the default without --gpus or --dp) x TP x PP x CP = 2 x 1 x 1 = 2" in built.notes


@pytest.mark.parametrize("argv, fragment", [
    (["--recipe", WITH_LORA, *TINY], "--gpus: vanilla_gpt_with_lora's name states no GPU count, and neither "
                                   "--gpus nor --dp was given, so the data-parallel size is unknown. Fix: give the "
                                   "run's world size, e.g. --gpus 8"),
    (["--hf-config", QWEN3_8B, "--seq", "4096", "--tp", "2", "--gpus", "7"],
     "--gpus: 7 GPUs (--gpus) are not divisible by TP x PP x CP = 2 x 1 x 1 = 2. Fix: give a world size that is a "
     "multiple of it, e.g. --gpus 6"),
    (["--hf-config", QWEN3_8B, "--seq", "4096", "--tp", "2", "--gpus", "8", "--dp", "2"],
     "--dp: --dp 2 and --gpus 8 disagree: 8 GPUs / (TP x PP x CP = 2 x 1 x 1 = 2) = DP 4. Fix: give one of them"),
    (["--recipe", QWEN3_RECIPE, "--hf-config", QWEN3_8B, "--tp", "2"],
     "--gpus: 1 GPUs (the GPU count qwen3_8b_peft_1gpu_h100_bf16_config's name states; --gpus N changes it) are not "
     "divisible by TP x PP x CP = 2 x 1 x 1 = 2"),
    (["--hf-config", QWEN3_8B, "--seq", "4096", "--gpus", "0"], "--gpus: 0 is not a whole number of 1 or more"),
], ids=["recipe-without-a-count", "not-divisible", "disagrees-with-dp", "layout-outgrows-the-stated-count", "zero"])
def test_a_world_size_that_cannot_be_is_one_line(capsys, argv, fragment):
    assert fragment in _one_line_error(capsys, [*argv, "--gpu-memory", "80GiB"])


# ------------------------------------------------------------------------------------------------
# Inputs a run would refuse or read otherwise, refused or said before the estimate
# ------------------------------------------------------------------------------------------------

QWEN_SEQ = ["--hf-config", QWEN3_8B, "--seq", "4096", "--gpu-memory", "80GiB"]


@pytest.mark.parametrize("argv, fragment", [
    ([*QWEN_SEQ, "++peft.dim=64"], "overrides: ++peft.dim=64 sets a field of peft, which this config leaves unset"),
    ([*QWEN_SEQ, "+peft.dim=64"], "overrides: +peft.dim=64 sets a field of peft"),
    ([*QWEN_SEQ, "model.virtual_pipeline_model_parallel_size=2"],
     "model.virtual_pipeline_model_parallel_size: is 2 with PP=1: Megatron Core refuses an interleaved schedule"),
    ([*QWEN_SEQ, "--pp", "4", "--global-batch", "2", "model.virtual_pipeline_model_parallel_size=3"],
     "train.global_batch_size: gives 2 microbatch(es) per step, and the interleaved schedule (PP=4, VPP=3) runs them "
     "in groups of 4"),
    ([*QWEN_SEQ, "dataset.seq_length=8192"], "dataset.seq_length: is 8192 and model.seq_length is 4096: Bridge "
                                             "requires them to match"),
    ([*QWEN_SEQ, "--sp"], "--sp: turns sequence parallelism on with TP=1: Megatron Core refuses it"),
], ids=["peft-field-without-peft", "peft-append-without-peft", "vpp-without-pp", "fewer-microbatches-than-pp",
        "dataset-seq-differs", "sp-with-tp-1"])
def test_what_the_run_would_refuse_is_one_line_before_the_estimate(capsys, argv, fragment):
    assert fragment in _one_line_error(capsys, argv)


def test_overrides_may_stand_between_and_after_the_options(capsys):
    report = _json_plan(capsys, "--hf-config", QWEN3_8B, "model.num_layers=2", "--seq", "4096", "--tp", "2",
                        "model.hidden_size=512", "--gpu-memory", "80GiB")
    settings = report["estimate"]["settings"]
    assert (settings["num_layers"], settings["hidden"], settings["tp"]) == (2, 512, 2)
    assert "unrecognized arguments: --bogus" in _argparse_error(capsys, [*QWEN_SEQ, "a=1", "--bogus"])


def _argparse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit):
        cli.main(["plan", *argv])
    return capsys.readouterr().err


def test_the_optimizer_turned_off_alone_is_estimated_distributed_as_bridge_runs_it(capsys):
    """Bridge's validation turns the distributed optimizer back on while ddp.use_distributed_optimizer is true (the
    vanilla container leaves ddp's off and the optimizer's on: synced on as well)."""
    tiny = ["model.num_layers=2", "--tp", "2", "--dp", "4"]
    alone = _json_plan(capsys, *QWEN_SEQ, *tiny, "ddp.use_distributed_optimizer=true",
                       "optimizer.use_distributed_optimizer=false")
    both = _json_plan(capsys, *QWEN_SEQ, *tiny, "optimizer.use_distributed_optimizer=false",
                      "ddp.use_distributed_optimizer=false")
    default = _json_plan(capsys, *QWEN_SEQ, *tiny)
    states = {name: next(c["bytes"] for c in r["estimate"]["components"] if c["name"] == "optimizer states")
              for name, r in (("alone", alone), ("both", both), ("default", default))}
    assert states["alone"] == states["default"] and states["both"] > states["alone"]
    assert any("Bridge's validation turns the distributed optimizer on for both" in a
               for a in alone["estimate"]["assumptions"])


QWEN3_8B_RECIPE = "megatron.bridge.recipes.qwen.h100.qwen3:qwen3_8b_pretrain_16gpu_h100_bf16_config"


def test_readme_qwen3_8b_recipe_plans_with_local_attention(capsys):
    """The README's Qwen3-8B recipe with ``--attention local``: Core's unfused attention normalises its scores with
    Apex's fused softmax (masked_softmax_fusion, s = 4096) and the recipe's loss is TE's cross entropy, both by
    stand-ins. Each layer keeps the kernel's bf16 probabilities [b, heads / t, s, s] (2 B an element) and less than
    torch's fp32 ones (4 B) would be."""
    report = _json_plan(capsys, "--recipe", QWEN3_8B_RECIPE, "--hf-config", QWEN3_8B, "--gpu-memory", "80GiB",
                        "--attention", "local")
    estimate = report["estimate"]
    s = estimate["settings"]
    assert s["attention"] == "local" and s["dtype"] == "bfloat16"
    probs = s["micro_batch"] * s["heads"] // s["tp"] * s["seq_length"] ** 2
    per_layer = estimate["activations_per_microbatch"]["attention"] / s["layers_on_stage"]
    assert 2 * probs < per_layer < 4 * probs
    notes = " ".join(estimate["assumptions"])
    assert "estimate.features.softmax" in notes and "estimate.features.cross_entropy" in notes
