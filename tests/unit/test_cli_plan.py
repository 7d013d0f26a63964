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
    report = _json_plan(capsys, "--recipe", WITH_LORA, "--tp", "2", "--sp", "--seq", "1024", "--gpu-memory", "1MB",
                        *TINY)
    switching = [o for o in report["options"] if o["applicable"] and o["memory_config"].get("lora_sp_input")]
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
        assert pasted.peft.strategy == option["memory_config"]["lora_sp_input"]
        assert pasted.peft.dim == plan_recipes.LORA_DIM  # the recipe's own PEFT, switched, not replaced
        for name in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"):
            assert getattr(pasted.model, name) == getattr(expected.model, name), name


def test_peft_flag_with_the_strategy_overrides_traces_the_strategy(capsys):
    report = _json_plan(capsys, "--recipe", VANILLA, "--tp", "2", "--seq", "1024", "--peft", "lora", "--gpu-memory",
                        "80GB", *TINY, *OUR_LORA)
    settings = report["estimate"]["settings"]
    assert settings["lora_sp_input"] == "shard_local" and settings["lora_dim"] == 32  # --lora-dim's default


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
    assert "MemoryConfig(lora_sp_input=...).apply(cfg)" in line


def test_neither_recipe_nor_config_json_is_one_line(capsys):
    assert "--recipe MODULE:FUNCTION or --hf-config FILE" in _one_line_error(capsys, ["--gpu-memory", "80GB"])


@pytest.mark.parametrize("sp, expected", [([], True), (["--no-sp"], False)])
def test_tp_on_a_recipe_turns_sequence_parallelism_on_as_with_a_config_json(capsys, sp, expected):
    argv = ["plan", "--recipe", VANILLA, "--tp", "2", "--seq", "1024", *sp, "--gpu-memory", "80GB", *TINY]
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
    report = _json_plan(capsys, "--recipe", QWEN3_RECIPE, "--hf-config", str(path), "--tp", "2", "--seq", "1024",
                        "--gpu-memory", "200GB")
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
