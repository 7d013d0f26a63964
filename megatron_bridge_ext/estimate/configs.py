"""Bridge training configs to estimate: from a recipe, or offline from a Hugging Face ``config.json``.

Bridge's model recipes fetch their Hugging Face config from the hub when called, so they do not run
offline. :func:`from_hf_config` builds the same provider from a local ``config.json`` (through
``AutoBridge.from_hf_config``, which downloads nothing) inside the container of Bridge's vanilla GPT
recipe, and sets what the estimate needs: parallel sizes, sequence, batch, optimizer sharding and
PEFT. :func:`from_recipe` calls any recipe ``module:function``. Both take Hydra-style overrides,
applied by Bridge's own override parser. Every problem is a :class:`Refused` with one line per
setting, raised before anything is built.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding, Refused

WHAT = "mbx plan input"

# What AutoBridge needs from a causal LM's config.json to build a GPT provider.
REQUIRED_HF_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                      "vocab_size")


def _refuse(setting: str, message: str, fix: str) -> Refused:
    return Refused(WHAT, [Finding("bad_input", ERROR, setting, message, fix)])


@dataclass(kw_only=True)
class Layout:
    """Parallel sizes, batch and PEFT for a ``config.json`` (a recipe keeps its own unless set here).

    ``peft``: ``lora``, ``dora`` or ``canonical_lora`` (Bridge's class of that kind on the layers of
    ``lora_targets``, named as the kind names them), or ``none`` for full fine-tuning.

    ``None`` keeps the recipe's value (for a ``config.json``: TP/PP/DP 1, SP with TP > 1, micro-batch 1).
    ``global_batch`` defaults to micro-batch x DP x PP: a full pipeline of microbatches.
    """

    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    seq: Optional[int] = None
    micro_batch: Optional[int] = None
    global_batch: Optional[int] = None
    sequence_parallel: Optional[bool] = None
    peft: Optional[str] = None
    lora_dim: int = 32
    lora_alpha: int = 32
    lora_targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    distributed_optimizer: Optional[bool] = None


def _bridge():
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()


def read_hf_config(path: str) -> dict:
    """The JSON of a Hugging Face config file, checked for the fields the GPT provider needs."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise _refuse("--hf-config", f"{path}: no such file", "give the path of the model's config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _refuse("--hf-config", f"{path}: not a readable JSON file ({error})",
                      "give the model's config.json from its Hugging Face repository") from None
    if not isinstance(data, dict):
        raise _refuse("--hf-config", f"{path}: the JSON is not an object", "give the model's config.json")
    missing = [name for name in REQUIRED_HF_FIELDS if name not in data]
    if missing:
        raise _refuse("--hf-config", f"{path} lacks {', '.join(missing)}",
                      "use the model's full config.json from its Hugging Face repository")
    return data


def from_hf_config(path: str, layout: Layout, overrides: list[str] = ()):
    """A ConfigContainer for the model of ``config.json`` at ``path``, laid out by ``layout``."""
    data = read_hf_config(path)
    _bridge()
    from transformers import AutoConfig

    from megatron.bridge import AutoBridge
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config

    if "torch_dtype" in data and "dtype" not in data:  # the older spelling, which transformers now warns about
        data["dtype"] = data.pop("torch_dtype")
    try:
        hf_config = AutoConfig.for_model(**data)
        provider = AutoBridge.from_hf_config(hf_config).to_megatron_provider(load_weights=False)
    except (ValueError, KeyError, TypeError) as error:
        raise _refuse("--hf-config", f"{path}: Megatron Bridge cannot build a model from it ({_first_line(error)})",
                      "give the config.json of a causal LM that Megatron Bridge supports") from None
    cfg = vanilla_gpt_pretrain_config()
    cfg.model = provider
    cfg.model.tensor_model_parallel_size = cfg.model.pipeline_model_parallel_size = 1
    cfg.model.context_parallel_size = 1
    cfg.train.micro_batch_size = 1
    _set_layout(cfg, layout, default_dp=1)
    return _with_overrides(cfg, overrides)


def from_recipe(spec: str, layout: Layout, overrides: list[str] = ()):
    """The ConfigContainer a Bridge recipe ``module:function`` returns, with ``layout`` and ``overrides``."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise _refuse("--recipe", f"{spec!r} is not MODULE:FUNCTION",
                      "write e.g. megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config")
    _bridge()
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise _refuse("--recipe", f"cannot import {module_name!r} ({_first_line(error)})",
                      "give an importable recipe module") from None
    recipe = getattr(module, function_name, None)
    if not callable(recipe):
        raise _refuse("--recipe", f"{module_name} has no function {function_name!r}",
                      "give a recipe function of that module") from None
    try:
        cfg = recipe()
    except Exception as error:  # a recipe may fail in any way (most fetch a Hugging Face config)
        raise _refuse("--recipe", f"{spec}() failed: {type(error).__name__}: {_first_line(error)}",
                      "recipes that fetch a Hugging Face config need the hub; offline, use --hf-config with the "
                      "model's config.json") from None
    from megatron.bridge.training.config import ConfigContainer

    if not isinstance(cfg, ConfigContainer):
        raise _refuse("--recipe", f"{spec}() returned {type(cfg).__name__}, not a ConfigContainer",
                      "give a Bridge recipe function")
    _set_layout(cfg, layout, default_dp=None)
    return _with_overrides(cfg, overrides)


def _set_layout(cfg, layout: Layout, *, default_dp: Optional[int]) -> None:
    model = cfg.model
    for attr, value in (("tensor_model_parallel_size", layout.tp), ("pipeline_model_parallel_size", layout.pp),
                        ("seq_length", layout.seq)):
        if value is not None:
            setattr(model, attr, value)
    if layout.sequence_parallel is not None:
        model.sequence_parallel = layout.sequence_parallel
    elif default_dp is not None:  # a config.json: SP whenever TP > 1
        model.sequence_parallel = model.tensor_model_parallel_size > 1
    if layout.micro_batch is not None:
        cfg.train.micro_batch_size = layout.micro_batch
    dp = layout.dp or getattr(cfg, "data_parallel_size", None) or default_dp
    if dp is not None:
        cfg.data_parallel_size = dp
    if layout.global_batch is not None:
        cfg.train.global_batch_size = layout.global_batch
    elif default_dp is not None:
        cfg.train.global_batch_size = cfg.train.micro_batch_size * (dp or 1) * model.pipeline_model_parallel_size
    if layout.distributed_optimizer is not None:
        cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = layout.distributed_optimizer
    if layout.peft == "none":
        cfg.peft = None
    elif layout.peft is not None:
        from megatron_bridge_ext.peft import kinds

        if layout.peft not in kinds.KINDS:
            raise _refuse("--peft", f"{layout.peft!r} is not one of {', '.join(kinds.KINDS)} or none",
                          f"use --peft {' or '.join(kinds.KINDS)}, or --peft none")
        cfg.peft = kinds.bridge_class(layout.peft)(target_modules=kinds.target_names(layout.peft, layout.lora_targets),
                                                   dim=layout.lora_dim, alpha=layout.lora_alpha)


def _with_overrides(cfg, overrides):
    if not overrides:
        return cfg
    import megatron_bridge_ext.peft.lora  # noqa: F401  (lets Bridge's override parser build our LoRA)

    try:
        from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    except ImportError as error:
        raise _refuse("overrides", f"Bridge's override parser is not importable ({_first_line(error)})",
                      "install hydra-core, or pass no overrides") from None
    try:
        return process_config_with_overrides(cfg, cli_overrides=list(overrides))
    except Exception as error:  # Hydra and OmegaConf raise many kinds for a bad override
        raise _refuse("overrides", f"{' '.join(overrides)}: {type(error).__name__}: {_first_line(error)}",
                      "write overrides as key=value (model.seq_length=8192), +key=value to add a field") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
