"""``mbx plan``: bad input gives one line and exit status 2 before anything is built; good input prints
the estimate beside Bridge's, the levers in order and the answer (text, JSON, plot)."""

from __future__ import annotations

import json
import os

import pytest

from megatron_bridge_ext import cli

pytestmark = [pytest.mark.unit]

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
    (["--hf-config", QWEN3_8B, "--tp", "3"], "model.tensor_model_parallel_size: TP=3 does not divide the 32 attention "
                                             "heads"),
    (["--hf-config", QWEN3_8B, "--tp", "2", "--seq", "8191"], "model.seq_length: sequence 8191 is not divisible by "
                                                              "TP=2"),
    (["--hf-config", QWEN3_8B, "--pp", "5"], "PP=5 does not divide the 36 layers"),
    (["--hf-config", QWEN3_8B, "--micro-batch", "0"], "train.micro_batch_size: is 0"),
    (["--hf-config", QWEN3_8B, "--margin", "1.5"], "--margin: 1.5 is not a share"),
])
def test_bad_input_is_one_line(capsys, argv, expected):
    line = _one_line_error(capsys, [*argv, "--gpu-memory", "80GB"])
    assert expected in line
    assert "Fix: " in line


def test_config_json_missing_fields_is_one_line(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 128}))
    line = _one_line_error(capsys, ["--hf-config", str(path), "--gpu-memory", "80GB"])
    assert "lacks num_hidden_layers, num_attention_heads, intermediate_size" in line


def test_plot_without_matplotlib_is_one_line(capsys, monkeypatch, tmp_path):
    from megatron_bridge_ext.cli import plan as plan_cli

    monkeypatch.setattr(plan_cli, "_have_matplotlib", lambda: False)
    line = _one_line_error(capsys, ["--hf-config", QWEN3_8B, "--gpu-memory", "80GB", "--plot", str(tmp_path / "x.png")])
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


def test_text_output_walks_the_levers_and_answers(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "plan.png"
    argv = ["plan", "--hf-config", LLAMA3_8B, "--tp", "2", "--seq", "8192", "--peft", "lora", "--dp", "2",
            "--gpu-memory", "4GB", "--plot", str(plot), "model.num_layers=2"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    order = ["per-rank estimate", "Bridge's estimate_training_memory", "does not fit as is",
             "levers, in the decision order", "answer:", "assumptions:"]
    positions = [text.index(marker) for marker in order]
    assert positions == sorted(positions)
    steps = [line.split()[0] for line in text[positions[3]:positions[4]].splitlines()[3:] if line[:3].strip().isdigit()]
    assert steps == sorted(steps, key=int) and steps[:2] == ["1", "2"]
    assert "MemoryConfig(" in text or "no combination of the levers fits" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
