"""``mbx plan --recipe`` on one recipe of every family Megatron Bridge ships, as a user runs it: no crash, and a
recipe the estimate does not answer is one the support matrix names, for the reason the command gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
PREFIX = "megatron.bridge.recipes."
FAMILY_RECIPES = {
    # family: (recipe after megatron.bridge.recipes., its model's folder under tests/data or None)
    "deepseek": ("deepseek.h100.deepseek_v2:deepseek_v2_lite_pretrain_8gpu_h100_bf16_config", "deepseek-v2-lite"),
    "exaone": ("exaone.h100.exaone4:exaone4_1p2b_sft_1gpu_h100_bf16_config", "exaone-4.0-1.2b"),
    "gemma": ("gemma.h100.gemma2:gemma2_9b_pretrain_8gpu_h100_bf16_config", "gemma-2-9b"),
    "glm": ("glm.h100.glm45:glm45_air_106b_peft_8gpu_h100_bf16_config", "glm-4.5-air"),
    "gpt": ("gpt.h100.gpt3_175b:gpt3_175b_pretrain_32gpu_h100_bf16_config", None),
    "gpt_oss": ("gpt_oss.h100.gpt_oss:gpt_oss_20b_sft_8gpu_h100_bf16_config", "gpt-oss-20b"),
    "kimi": ("kimi.h100.kimi_k2:kimi_k2_pretrain_512gpu_h100_bf16_config", "kimi-k2-instruct"),
    "llama": ("llama.h100.llama3:llama31_8b_pretrain_2gpu_h100_bf16_config", "llama-3.1-8b"),
    "minimax": ("minimax.h100.minimax_m3:minimax_m3_sft_128gpu_h100_bf16_config", "minimax-m3"),
    "moonlight": ("moonlight.h100.moonlight_16b:moonlight_16b_sft_8gpu_h100_bf16_8k_config", "moonlight-16b-a3b"),
    "nemotronh": ("nemotronh.h100.nemotron_3_nano_4b:nemotron_3_nano_4b_sft_8gpu_h100_bf16_config", None),
    "olmoe": ("olmoe.h100.olmoe_7b:olmoe_7b_sft_8gpu_h100_bf16_config", None),
    "qwen": ("qwen.h100.qwen3:qwen3_8b_peft_1gpu_h100_bf16_config", "qwen3-8b"),
    "stepfun": ("stepfun.h100.step35:step35_196b_a11b_pretrain_512gpu_h100_bf16_config", "step-3.5-flash"),
}
REFUSED, NOT_MODELLED = 2, 3
"""``mbx plan``'s statuses for an input it refuses and for a model whose features the estimate does not model."""


def test_every_family_of_the_installed_bridge_has_its_recipe():
    from megatron_bridge_ext.estimate.recipes import language_recipes

    recipes = language_recipes()
    assert set(FAMILY_RECIPES) == {r.family for r in recipes}
    assert {PREFIX + spec for spec, _ in FAMILY_RECIPES.values()} <= {r.spec for r in recipes}


def _matrix_reason(spec: str) -> str:
    """The matrix's line for a recipe it lists as not estimated: ``refused: setting: why``, or '' when not listed."""
    page = (ROOT / "docs" / "support-matrix.md").read_text()
    return next((line[2:] for line in page.splitlines() if line.startswith("- ") and f"`{spec}`" in line), "")


@pytest.mark.parametrize("family", sorted(FAMILY_RECIPES))
def test_a_familys_recipe_is_planned_or_refused_as_the_matrix_says(family):
    spec, folder = FAMILY_RECIPES[family]
    command = [sys.executable, "-m", "megatron_bridge_ext.cli", "plan", "--recipe", PREFIX + spec,
               "--gpu-memory", "80GiB"] + (["--hf-config", str(DATA / folder / "config.json")] if folder else [])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "please report" not in output, output[-4000:]
    listed = _matrix_reason(spec)
    if done.returncode == 0:
        assert "per-rank estimate" in done.stdout and not listed, (listed, done.stdout[-2000:])
        return
    assert done.returncode in (REFUSED, NOT_MODELLED), output[-4000:]
    assert listed.startswith("refused: "), f"{spec} is refused but the support matrix does not list it:\n{output}"
    setting = listed.split(": ")[1]
    assert setting in output, (listed, output[-4000:])
