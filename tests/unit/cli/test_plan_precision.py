"""``mbx plan`` with Bridge's mixed-precision recipes selected by override: FP8 estimated with TE's quantised
weights and its activations named as not modelled; FP4 and unknown recipe names refused in one line."""

from __future__ import annotations

import json
import os

import pytest

from megatron_bridge_ext import cli
from megatron_bridge_ext.cli import plan as plan_cli
from megatron_bridge_ext.render import plan as render_plan
from tests.support.settings import gpt_stage

pytestmark = [pytest.mark.unit]

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
LLAMA3_8B = os.path.join(DATA, "llama-3-8b", "config.json")
ARGV = ["plan", "--hf-config", LLAMA3_8B, "--tp", "2", "--pp", "2", "--seq", "1024", "--gpu-memory", "80GiB"]
# Llama 3 8B on TP 2, per layer: linear_qkv [(32 + 2 * 8) * 128 / 2, 4096], linear_proj [4096, 2048],
# linear_fc1 [2 * 14336 / 2, 4096], linear_fc2 [4096, 7168].
LAYER = 3072 * 4096 + 4096 * 2048 + 14336 * 4096 + 4096 * 7168


def _run(capsys, *argv) -> tuple[int, str, str]:
    status = cli.main([*ARGV, *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def test_fp8_current_scaling_stores_15_fp8_layers_of_a_stage_quantised(capsys):
    """32 layers over PP 2: each stage holds 16, one of them (the model's first or last) kept in bf16 by the
    recipe; FP8 parameters: data + transpose, 1 B each, and a 4 B scale per weight."""
    status, out, _ = _run(capsys, "--json", "mixed_precision=bf16_with_fp8_current_scaling_mixed")
    assert status == 0
    report = json.loads(out)
    components = {c["name"]: c["bytes"] for c in report["estimate"]["components"]}
    assert components["weights: FP8 linear weights"] == 15 * (2 * LAYER + 4 * 4)
    assert not [n for n in report["not_modelled"] if "activations under FP8" in n]  # TE's contract models them
    assert [a for a in report["estimate"]["assumptions"] if a.startswith("FP8 activations by Transformer Engine")]


def test_the_text_plan_names_blockwise_fp8_activations_once_as_not_modelled(capsys):
    status, out, _ = _run(capsys, "mixed_precision=bf16_with_fp8_subchannel_scaling_mixed")
    assert status == 0
    named = [line for line in out.splitlines() if "activations under FP8 are not modelled" in line]
    assert len(named) == 1 and named[0].startswith("not modelled: activations under FP8")
    [config] = [line for line in out.splitlines() if line.startswith("config: ")]
    # Bridge's bf16_with_fp8_subchannel_scaling_mixed (training/mixed_precision.py L382-383): fp8="hybrid", fp8_recipe="blockwise" (not the dtype alone)
    assert ", bfloat16 with FP8 hybrid, recipe blockwise, " in config


def test_the_fp8_words_of_the_config_line_come_from_the_models_fields():
    from types import SimpleNamespace

    from megatron_bridge_ext.estimate.memory import _fp8_text

    model = SimpleNamespace(fp8="hybrid", fp8_recipe="mxfp8", fp8_param=True, first_last_layers_bf16=True,
                            num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2, num_layers=8)
    assert _fp8_text(model) == ("FP8 hybrid, recipe mxfp8, FP8 parameters (fp8_param_gather); the first 1 and last "
                                "2 layer(s) in bf16")
    assert _fp8_text(SimpleNamespace(fp8=None)) is None
    settings = gpt_stage(dtype="bfloat16", fp8="FP8 hybrid, recipe mxfp8")
    assert render_plan._precision(settings) == "bfloat16 with FP8 hybrid, recipe mxfp8"
    assert render_plan._precision(gpt_stage(dtype="bfloat16", fp8=None)) == "bfloat16"


def test_an_fp4_recipe_is_a_named_refusal_beside_bridges_failure(capsys):
    status, out, _ = _run(capsys, "mixed_precision=bf16_with_nvfp4_mixed")
    assert status == plan_cli.NOT_MODELLED_STATUS
    [line] = [line for line in out.splitlines() if line.startswith("our estimate: ")]
    assert line.startswith("our estimate: not modelled: mixed_precision: FP4 training is not modelled by the estimate; ")
    assert "Blackwell" in line and line.endswith(". Fix: estimate the bf16 or FP8 config")


def test_an_unknown_mixed_precision_name_is_one_line_and_exit_2(capsys):
    status, out, err = _run(capsys, "mixed_precision=bf16_with_fp9")
    assert status == 2 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("mbx plan: mixed_precision: 'bf16_with_fp9' is not a mixed-precision recipe of Bridge's. "
                           "Fix: use one of bf16_mixed, bf16_with_fp8_current_scaling_mixed")
