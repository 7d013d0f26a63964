"""``mbx plan``: bad input gives one line and exit status 2 before anything is built; good input prints
the estimate beside Bridge's, the levers in order and the answer (text, JSON, plot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_bridge_ext import cli
from megatron_bridge_ext.cli import plan as plan_cli

pytestmark = [pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[2]
DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
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
])
def test_bad_input_is_one_line(capsys, argv, expected):
    line = _one_line_error(capsys, [*argv, "--gpu-memory", "80GiB"])
    assert expected in line
    assert ". Fix: " in line


FAST_REFUSALS = [
    (["--tp", "3"], "model.tensor_model_parallel_size: TP=3 does not divide the 32 attention heads. Fix: choose "
                    "sizes that divide it"),
    (["--tp", "16"], "TP=16 does not divide the 8 query groups"),
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
]


@pytest.mark.parametrize("argv, expected", FAST_REFUSALS, ids=[" ".join(a) for a, _ in FAST_REFUSALS])
def test_numbers_and_the_hf_layout_are_refused_before_torch_is_imported(argv, expected):
    """Each refusal comes from the arguments and config.json alone, in a fresh interpreter that never imports torch."""
    argv = ["--hf-config", QWEN3_8B, "--seq", "8192", "--gpu-memory", "80GiB", *argv]
    code = ("import sys; from megatron_bridge_ext import cli; rc = cli.main(['plan', *sys.argv[1:]]); "
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr); "
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    line, imported = done.stderr.splitlines()
    assert line.startswith("mbx plan: ") and expected in line
    assert imported == "torch not imported"


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
    settings = {"tp": 1, "pp": 1, "vpp": None, "dp": 1, "sequence_parallel": False, "seq_length": 4096,
                "micro_batch": 1, "num_microbatches": 1, "dtype": "bfloat16", "peft": None,
                "recompute_granularity": None, "attention": "fused", "transformer_impl": "transformer_engine"}
    line = plan_cli._settings_line(settings, peft_defaulted=True)
    assert "full fine-tuning (the default; --peft lora for LoRA)" in line
    assert "the default" not in plan_cli._settings_line(settings)


def small_plan(*, gpu_memory: int, lora_sp_input: str = "off"):
    """A plan of the demo's tiny GPT (TP 2, SP, LoRA) on a device of ``gpu_memory`` bytes."""
    from megatron_bridge_ext import plan as planner
    from megatron_bridge_ext.demo.tiny_model import TinyGPTShape
    from megatron_bridge_ext.estimate.device import tiny_config
    from megatron_bridge_ext.peft import LoRA

    shape = TinyGPTShape(layers=2, hidden=64, ffn=256, heads=8, kv_heads=4, seq=512, micro_batch=1, vocab=128, tp=2,
                         dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, LoRA(target_modules=list(shape.lora_targets), dim=shape.lora_rank, alpha=16,
                                  sequence_parallel_input_strategy=lora_sp_input))
    cfg.data_parallel_size, cfg.train.global_batch_size = 2, 2
    return planner.plan(cfg, gpu_memory=gpu_memory, expandable_segments=False)


def test_why_an_option_does_not_apply_goes_below_a_narrow_table():
    """LoRA-A already shard_local: step 2 is n/a, and its reason is a note under the table, not a table cell."""
    text = plan_cli.format_plan(small_plan(gpu_memory=1, lora_sp_input="shard_local"))
    table, notes = text.split("  step  option")[1].split("why not, constraints")
    assert all(len(line) <= 120 for line in table.splitlines()), table
    assert "already shard_local" not in table
    assert "  - step 2 lora_sp_input=shard_local: n/a: already shard_local" in notes.splitlines()


@pytest.mark.parametrize("label", ["recompute_modules=['core_attn', 'mlp']", "offload 35 of 36 layers (no recompute)",
                                   "lora_sp_input=shard_local"])
def test_plot_labels_wrap_between_words_only(label):
    assert plan_cli.tick_label(label).split() == label.split()


def test_config_json_missing_fields_is_one_line(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 128}))
    line = _one_line_error(capsys, ["--hf-config", str(path), "--gpu-memory", "80GiB"])
    assert "lacks num_hidden_layers, num_attention_heads, intermediate_size" in line


def test_plot_without_matplotlib_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(plan_cli, "_have_matplotlib", lambda: False)
    line = _one_line_error(capsys, ["--hf-config", QWEN3_8B, "--seq", "4096", "--gpu-memory", "80GiB", "--plot",
                                    str(tmp_path / "x.png")])
    assert 'pip install "megatron-bridge-ext[plot]"' in line


def test_qwen3_8b_lora_json(capsys):
    argv = ["plan", "--hf-config", QWEN3_8B, "--tp", "2", "--seq", "8192", "--peft", "lora", "--dp", "4",
            "--gpu-memory", "80GB", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    settings = report["estimate"]["settings"]
    assert (settings["tp"], settings["sequence_parallel"], settings["seq_length"], settings["dp"]) == (2, True, 8192, 4)
    assert settings["peft"].endswith("LoRA") and settings["lora_sp_input"] == "off"
    assert report["fits_as_is"] is True and report["options"] == []
    # Bridge's own estimate charges the frozen base with gradients and optimizer states.
    assert report["bridge_estimate"]["total_bytes"] > report["estimate"]["peak_bytes"]
    assert report["usable_now"] == int(80e9 * (1 - report["margin"]))
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
    assert "MemoryConfig(" in text or "no combination of the levers fits" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
