"""The language-model recipes the installed Megatron Bridge ships, as ``module:function`` specs by family.

Bridge exports its recipes from ``megatron.bridge.recipes``: one package per model family, with one module per
model under the family (the legacy names) and under a GPU folder (``h100/``, ``gb200/``, ``gb300/``). A recipe is
a public function of such a module, defined there, whose name ends in ``_config`` (the legacy modules re-export
the GPU modules' functions under older names: each recipe is counted once, where it is defined). The families
of vision-language, audio and diffusion models (:data:`NOT_LANGUAGE`) and the vision-language recipes inside a
language family (``_vl_`` in the name, or a captioning data set) are left out: the estimate plans language
models.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass

NOT_LANGUAGE = ("flux", "wan", "gemma3_vl", "gemma4_vl", "glm_vl", "kimi_vl", "qwen_vl", "qwen_omni", "qwen2_audio",
                "nemotron_omni", "nemotron_vl", "ministral3", "utils")
"""Recipe packages of models that are not language models (or, ``utils``, of shared helpers)."""
NOT_LANGUAGE_NAME = re.compile(r"_vl_|flickr|_vlm_")
"""A vision-language recipe inside a language family (``exaone45_vl_33b_...``, ``step37_sft_..._flickr8k_...``)."""


@dataclass(frozen=True)
class Recipe:
    family: str
    module: str
    function: str

    @property
    def spec(self) -> str:
        return f"{self.module}:{self.function}"


def language_recipes() -> list[Recipe]:
    """Every language-model recipe of the installed Bridge, in module order (Bridge imported on first call)."""
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    import megatron.bridge.recipes as package

    out = []
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        family = info.name.split(".")[3]
        if family in NOT_LANGUAGE or info.ispkg:
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (inspect.isfunction(value) and value.__module__ == info.name and name.endswith("_config")
                    and not name.startswith("_") and not NOT_LANGUAGE_NAME.search(name)):
                out.append(Recipe(family, info.name, name))
    return out
