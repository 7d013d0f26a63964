"""Bridge training configs to estimate: from a recipe, or offline from a Hugging Face ``config.json``.

Bridge's model recipes fetch their Hugging Face config from the hub when called, so they do not run
offline. :func:`from_hf_config` builds the same provider from a local ``config.json`` (through
``AutoBridge.from_hf_config``, which downloads nothing) inside the container of Bridge's vanilla GPT
recipe, and sets what the estimate needs: parallel sizes, sequence, batch, optimizer sharding and
PEFT. :func:`from_recipe` calls any recipe ``module:function``; given a ``config.json`` too, the
recipe's hub read is answered from it (patch ``bridge_recipe_hf_config``), and without one an
unreachable hub fails in seconds instead of minutes of retries. Both take Hydra-style overrides,
applied by Bridge's own override parser after :mod:`megatron_bridge_ext.overrides` has refused
what that parser would silently skip. :func:`build` also says how ``cfg.peft`` was built, which
decides whether the plan's answer can change it by overrides. Every problem is a :class:`Refused`
with one line per setting, raised before anything is built.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_bridge_ext.findings import ERROR, Finding, Refused

WHAT = "mbx plan input"

# What every causal LM's config.json states (the text model's, under ``text_config`` in a multimodal one); the
# layer count may be a pattern's length instead (``hybrid_override_pattern``, ``layers_block_type``). Other fields
# (``intermediate_size``, absent where every layer is MoE) are the model's bridge's to read.
REQUIRED_HF_FIELDS = ("model_type", "hidden_size", "num_attention_heads", "vocab_size")
LAYER_COUNT_FIELDS = ("num_hidden_layers", "hybrid_override_pattern", "layers_block_type")

# The model's shape fields, each with its config.json key. A set value below 1 builds nothing: Megatron
# Core divides by it or makes empty layers; None is left to Core, which derives the optional ones.
SHAPE_FIELDS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
                "num_attention_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
                "vocab_size": "vocab_size", "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim"}


def shape_fix(name: str) -> str:
    return f"set {name} to a whole number of 1 or more"


def bad_shape(value) -> bool:
    """A shape field's value that is set but not a whole number of 1 or more."""
    return value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1)


def imbalance_problem(value, setting: str = "moe_imbalance") -> Optional[Finding]:
    """A load factor below 1 (the most loaded expert carries at least the balanced load), as one finding, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < float("inf"):
        return Finding("bad_input", ERROR, setting, f"{value!r} is not a load factor of 1 or more (the most loaded "
                       "expert's tokens over the balanced share)", "give 1.0 for a balanced load, e.g. 1.5 for "
                       "an expert 50% over it")
    return None


def _refuse(setting: str, message: str, fix: str) -> Refused:
    return Refused(WHAT, [Finding("bad_input", ERROR, setting, message, fix)])


@dataclass(kw_only=True)
class Layout:
    """Parallel sizes, batch and PEFT for a ``config.json`` (a recipe keeps its own unless set here).

    ``peft``: ``lora``, ``dora`` or ``canonical_lora`` (Bridge's class of that kind on the layers of
    ``lora_targets``, named as the kind names them), or ``none`` for full fine-tuning.

    ``None`` keeps the recipe's value (for a ``config.json``: TP/PP/DP/EP 1, ETP = TP, micro-batch 1).
    ``sequence_parallel`` None: on when TP > 1, for a ``config.json`` and wherever ``tp`` is given (a
    recipe run without ``tp`` keeps its own setting).
    ``peft`` is built as the overrides ``++peft._target_=... ++peft.dim=...`` would build it; with
    peft overrides of the user's it is built by them together, the user's keys winning.
    ``global_batch`` defaults to micro-batch x DP x PP: a full pipeline of microbatches.
    ``gpus``: the world size; DP = gpus / (TP x PP x CP) once the recipe and the overrides have set those. A recipe
    given neither ``gpus`` nor ``dp`` runs on the GPU count its function's name states (``_16gpu_``); one whose name
    states none is refused with the fix (:func:`data_parallel`).
    """

    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    gpus: Optional[int] = None
    ep: Optional[int] = None
    etp: Optional[int] = None
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
    text = text_fields(data)
    missing = [name for name in REQUIRED_HF_FIELDS if name not in text]
    missing += [] if any(name in text for name in LAYER_COUNT_FIELDS) else [LAYER_COUNT_FIELDS[0]]
    if missing:
        where = " (nor does its text_config)" if isinstance(data.get("text_config"), dict) else ""
        raise _refuse("--hf-config", f"{path} lacks {', '.join(missing)}{where}",
                      "use the model's full config.json from its Hugging Face repository")
    return data


def text_fields(data: dict) -> dict:
    """The text model's fields of a config.json: a multimodal config's ``text_config`` over its top level (Bridge's
    multimodal bridges build the language model from ``text_config``), else the config itself."""
    text = data.get("text_config")
    return {**data, **text} if isinstance(text, dict) else data


@dataclass
class Built:
    """A config to plan, and what the plan's answer needs to know of how it was built.

    ``peft_overrides``: the override strings that build ``cfg.peft`` on a config whose ``cfg.peft``
    is None (``--peft``'s, less the keys the user's own overrides set), or None when ``cfg.peft``
    is an object the recipe set in Python, which no override can change.
    ``notes``: how the layout decided a setting the user did not give (sequence parallelism).
    """

    cfg: Any
    peft_overrides: Optional[list[str]] = None
    notes: list[str] = field(default_factory=list)


def from_hf_config(path: str, layout: Layout, overrides: list[str] = ()):
    """A ConfigContainer for the model of ``config.json`` at ``path``, laid out by ``layout``."""
    return build(layout, overrides, hf_config=path).cfg


def from_recipe(spec: str, layout: Layout, overrides: list[str] = (), hf_config: Optional[str] = None):
    """The ConfigContainer a Bridge recipe ``module:function`` returns, with ``layout`` and ``overrides``.

    ``hf_config``: a local ``config.json`` that answers the recipe's read of its Hugging Face config.
    """
    return build(layout, overrides, recipe=spec, hf_config=hf_config).cfg


def build(layout: Layout, overrides: list[str] = (), *, recipe: Optional[str] = None,
          hf_config: Optional[str] = None) -> Built:
    """The config of ``recipe`` (or, without one, of ``hf_config`` in the vanilla GPT recipe), laid out and
    overridden."""
    function, read = None, []
    if recipe is not None:
        cfg, function, read = _call_recipe(recipe, hf_config)
    else:
        cfg = _hf_config_container(hf_config)
    recipe_peft = cfg.peft is not None
    sp_by_default = _set_layout(cfg, layout, default_dp=None if recipe is not None else 1)
    layout_peft = _layout_peft_overrides(layout, overrides) if layout.peft not in (None, "none") else []
    cfg, resolved = resolve_named_fields(cfg, layout, overrides)
    cfg = _with_overrides(cfg, resolved)
    reachable = cfg.peft is not None and not recipe_peft  # built by --peft or by overrides, on a recipe without one
    notes = [data_parallel(cfg, layout, function)] + read
    notes += [n for n in [hf_config and unknown_model_type(read_hf_config(hf_config))] if n]
    notes += [n for n in [tokenizer_vocabulary(cfg, hf_config)] if n]
    notes += [n for n in [_sequence_parallel_without_tp(cfg.model, layout)] if n]
    notes += ["SP on: the default with TP > 1 (--no-sp turns it off)"] if sp_by_default and cfg.model.sequence_parallel \
        else []
    from megatron_bridge_ext.estimate import precision

    notes += precision.replaced_by_mixed_precision(cfg, overrides)
    return Built(cfg, layout_peft if reachable else None, notes)


def _sequence_parallel_without_tp(model, layout: Layout) -> Optional[str]:
    """Sequence parallelism a recipe or an override sets at TP 1, turned off as Bridge's ``finalize`` turns it off
    (``models/transformer_config.py`` L179-180), and a note saying so; ``--sp`` with TP 1 is refused instead
    (:func:`megatron_bridge_ext.plan_config.built_problem`): the user asked for it."""
    if not model.sequence_parallel or model.tensor_model_parallel_size > 1 or layout.sequence_parallel:
        return None
    model.sequence_parallel = False
    return "SP off: the config sets sequence_parallel at TP 1, which Bridge turns off when it finalizes the model"


NAMED_FIELDS = ("mixed_precision", "peft")
"""Fields a recipe name stands for (``mixed_precision=bf16_mixed``, ``--peft lora``) whose own fields overrides set
(``mixed_precision.grad_reduce_in_fp32=false``, ``peft.dim=8``)."""


def resolve_named_fields(cfg, layout: Layout, overrides) -> tuple[Any, list[str]]:
    """The config and the overrides to apply, each named field resolved to its config before its dotted overrides.

    Bridge's performance scripts do the same for mixed precision: their recipes set ``cfg.mixed_precision`` to the
    recipe's object (``scripts/performance/utils/precision.py``: ``get_precision_config``) before the Hydra
    overrides run (``utils/overrides.py``: ``set_cli_overrides``), so ``mixed_precision.<field>=`` changes that
    object. A mixed-precision name (the config's, or the last ``mixed_precision=NAME`` override) becomes Bridge's
    ``MixedPrecisionConfig`` of it when an override sets one of its fields; ``--peft KIND`` becomes its fields as
    ``++peft.<field>=`` overrides (Bridge's parser leaves a PEFT object out of the override tree, so the object
    cannot take them) placed before the user's, which change them (``peft.dim=8`` after ``++peft.dim=32``).
    """
    overrides = list(overrides)
    if overrides and _dotted(overrides, "mixed_precision"):
        cfg, overrides = _resolve_mixed_precision(cfg, overrides)
    if layout.peft in (None, "none"):
        if cfg.peft is None and _touches_peft(overrides) and "_target_" not in _peft_keys(overrides):
            first = _dotted(overrides, "peft")[0]
            raise _refuse("overrides", f"{first.input_line} sets a field of peft, which this config leaves unset (full "
                          "fine-tuning), so there is no PEFT for it to change",
                          "add --peft lora (or dora, canonical_lora): the override then changes that field; or name "
                          "the class first: ++peft._target_=megatron.bridge.peft.lora.LoRA "
                          f"++{first.key_or_group}=VALUE")
        return cfg, overrides
    if _touches_peft(overrides):
        cfg.peft = None  # --peft and the user's peft overrides build one PEFT together (theirs win)
        return cfg, _layout_peft_overrides(layout, overrides, fields_first=True) + overrides
    cfg.peft = _layout_peft_object(layout)
    return cfg, overrides


def _dotted(overrides, name: str) -> list:
    from megatron_bridge_ext import overrides as checks

    return [o for o in checks.parse(overrides) if o.key_or_group.startswith(name + ".")]


def _resolve_mixed_precision(cfg, overrides: list[str]) -> tuple[Any, list[str]]:
    """``cfg.mixed_precision`` as Bridge's config object when it is a recipe name; the ``mixed_precision=NAME``
    overrides are applied by that (the last one wins, as Hydra would apply it)."""
    from megatron_bridge_ext import overrides as checks
    from megatron_bridge_ext.estimate import precision

    parsed = checks.parse(overrides)
    named = [o for o in parsed if o.key_or_group == "mixed_precision" and not o.is_delete()]
    name = named[-1].value() if named else cfg.mixed_precision
    if name is None:
        raise _refuse("overrides", f"{_dotted(overrides, 'mixed_precision')[0].input_line} sets a field of "
                      "mixed_precision, which this config leaves unset (None)",
                      "name the recipe first, e.g. mixed_precision=bf16_mixed mixed_precision.grad_reduce_in_fp32=false")
    if isinstance(name, str):
        cfg.mixed_precision = precision.mixed_precision_named(name)
    return cfg, [o.input_line for o in parsed if all(o is not n for n in named)]



def _hf_config_container(path: str):
    data = read_hf_config(path)
    _bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config

    try:
        provider = AutoBridge.from_hf_config(hf_config_object(data)).to_megatron_provider(load_weights=False)
    except (ValueError, KeyError, TypeError) as error:
        raise _refuse("--hf-config", f"{path}: Megatron Bridge cannot build a model from it ({_first_line(error)})",
                      "give the config.json of a causal LM that Megatron Bridge supports") from None
    cfg = vanilla_gpt_pretrain_config()
    cfg.model = provider
    cfg.model.tensor_model_parallel_size = cfg.model.pipeline_model_parallel_size = 1
    cfg.model.context_parallel_size = 1
    cfg.train.micro_batch_size = 1
    return cfg


def hf_config_object(data: dict):
    """The transformers config of a ``config.json``'s JSON, as ``AutoConfig.from_pretrained`` would build it; for a
    ``model_type`` the installed transformers does not know (a model whose config class is remote code, Kimi K2's),
    a plain ``PretrainedConfig`` holding the file's fields as they are (:func:`unknown_model_type` says so): Bridge
    picks its model bridge by ``architectures`` and reads the fields by name."""
    from transformers import AutoConfig, PretrainedConfig

    data = dict(data)
    if "torch_dtype" in data and "dtype" not in data:  # the older spelling, which transformers now warns about
        data["dtype"] = data.pop("torch_dtype")
    if unknown_model_type(data):
        # The base class reads some fields by its own rules at construction: it standardises RoPE fields, reading
        # max_position_embeddings before it is set (transformers 5: modeling_rope_utils.standardize_rope_params),
        # and checks layer_types against num_hidden_layers, which a model with MTP layers in the list fails
        # (Step-3.5's 45 + 3): build it without them, then set every field as the file states it.
        config = PretrainedConfig.from_dict({k: v for k, v in data.items() if k not in RAW_FIELDS})
        for name, value in data.items():
            setattr(config, name, value)
        return config
    return AutoConfig.for_model(**data)


RAW_FIELDS = ("rope_scaling", "rope_parameters", "layer_types")
"""Fields of an unknown model type's config.json that transformers' base class would read by its own rules."""


def unknown_model_type(data: dict) -> Optional[str]:
    """A note when config.json's ``model_type`` is not one the installed transformers knows, else None."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if model_type in CONFIG_MAPPING:
        return None
    return (f"model_type {model_type!r} is not one transformers {transformers.__version__} knows (its config class is "
            "the model's own code): config.json's fields are read as they are")


def _call_recipe(spec: str, hf_config: Optional[str]):
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise _refuse("--recipe", f"{spec!r} is not MODULE:FUNCTION",
                      "write e.g. megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config")
    local = hf_config_object(read_hf_config(hf_config)) if hf_config is not None else None
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
    from megatron_bridge_ext.patches import bridge_recipe_hf_config

    with bridge_recipe_hf_config.answering(local) as hub:
        try:
            cfg = recipe()
        except Exception as error:  # a recipe may fail in any way (most fetch a Hugging Face config)
            if hub.unreachable:
                raise _refuse("--recipe", f"{spec}() reads {hub.requested}'s config from the Hugging Face hub, which "
                                          f"is not reachable ({hub.unreachable}), and it is not in the local cache.",
                              "add --hf-config with the model's config.json (the recipe's read is answered from "
                              "it), or run where the hub is reachable") from None
            raise _recipe_failed(spec, error) from None
    from megatron.bridge.training.config import ConfigContainer

    if not isinstance(cfg, ConfigContainer):
        raise _refuse("--recipe", f"{spec}() returned {type(cfg).__name__}, not a ConfigContainer",
                      "give a Bridge recipe function")
    if hf_config is not None and not hub.requested and not _vocabulary_from_hf_tokenizer(cfg):
        raise _refuse("--hf-config", f"{spec}() reads no Hugging Face config, so {hf_config} would not be used",
                      "drop --hf-config, or give a recipe that builds its model from a Hugging Face config")
    notes = [f"the recipe's read of the {hub.tokenizer} tokenizer answered with its length taken as {hf_config}'s "
             "vocab_size (no tokenizer files here)"] if hub.tokenizer else []
    return cfg, getattr(recipe, "__name__", function_name), notes


HF_TOKENIZER = "HuggingFaceTokenizer"


def _vocabulary_from_hf_tokenizer(cfg) -> bool:
    """The recipe leaves ``model.vocab_size`` to a Hugging Face model's tokenizer, whose config.json states it."""
    tokenizer = getattr(cfg, "tokenizer", None)
    return (getattr(cfg.model, "vocab_size", 1) is None and getattr(tokenizer, "tokenizer_type", None) == HF_TOKENIZER
            and bool(getattr(tokenizer, "tokenizer_model", None)))


def tokenizer_vocabulary(cfg, hf_config: Optional[str]) -> Optional[str]:
    """``model.vocab_size`` where the recipe leaves it to the tokenizer, as Bridge's setup sets it
    (``training/setup.py`` L294-299, ``_validate_and_set_vocab_size`` L702-706: the tokenizer's ``vocab_size``, with
    ``should_pad_vocab``), and a note saying so; None when the model states its vocabulary or nothing here does.

    A ``NullTokenizer`` states its size in ``cfg.tokenizer.vocab_size`` (Core's ``build_tokenizer``:
    ``kwargs['vocab_size'] = args.vocab_size``); a Hugging Face tokenizer's size is taken from the config.json of its
    model given with ``--hf-config`` (its ``vocab_size``: the model's embedding rows)."""
    model, tokenizer = cfg.model, getattr(cfg, "tokenizer", None)
    if getattr(model, "vocab_size", 1) is not None or tokenizer is None:
        return None
    kind = getattr(tokenizer, "tokenizer_type", None)
    if kind == "NullTokenizer" and getattr(tokenizer, "vocab_size", None):
        model.vocab_size, model.should_pad_vocab = tokenizer.vocab_size, True
        return (f"vocabulary {tokenizer.vocab_size}: the recipe's NullTokenizer(vocab_size={tokenizer.vocab_size}), "
                "padded as Bridge pads a tokenizer's vocabulary")
    if _vocabulary_from_hf_tokenizer(cfg) and hf_config is not None:
        vocab = text_fields(read_hf_config(hf_config)).get("vocab_size")
        if isinstance(vocab, int) and vocab > 0:
            model.vocab_size, model.should_pad_vocab = vocab, True
            return (f"vocabulary {vocab}: the recipe's tokenizer is {tokenizer.tokenizer_model}'s, its size taken as "
                    f"{hf_config}'s vocab_size, padded as Bridge pads a tokenizer's vocabulary")
    return None


_STATED_GPUS = re.compile(r"_(\d+)gpus?_")


def stated_gpus(function_name: Optional[str]) -> Optional[int]:
    """The GPU count a recipe function's name states (Bridge names them ``<model>_<task>_<N>gpu_<gpu>_<dtype>``,
    ``qwen3_8b_pretrain_16gpu_h100_bf16_config``), or None. An alias (``qwen3_8b_peft_config``) is named by the
    function it stands for."""
    match = _STATED_GPUS.search(f"_{function_name or ''}_")
    return int(match.group(1)) if match else None


def data_parallel(cfg, layout: Layout, function: Optional[str]) -> str:
    """Set ``cfg.data_parallel_size`` from ``--gpus``, ``--dp`` or the recipe's stated GPU count (in that order), and
    say how it was decided, as one note. A recipe with none of them is refused: its DP divides the optimizer's
    states and sets the microbatches of a step, so a silent DP 1 would misstate both."""
    model = cfg.model
    tp, pp, cp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size, model.context_parallel_size or 1
    per_replica = tp * pp * cp
    sizes = f"TP x PP x CP = {tp} x {pp} x {cp} = {per_replica}"
    stated = stated_gpus(function) if layout.gpus is None and layout.dp is None else None
    gpus, source = (layout.gpus, "--gpus") if layout.gpus is not None else (stated, f"the GPU count {function}'s name "
                                                                                     "states; --gpus N changes it")
    if gpus is not None:
        if gpus % per_replica:
            fix = "give a world size that is a multiple of it, e.g. --gpus " + str(per_replica * max(1, gpus // per_replica))
            raise _refuse("--gpus", f"{gpus} GPUs ({source}) are not divisible by {sizes}", fix)
        dp = gpus // per_replica
        if layout.dp is not None and layout.dp != dp:
            raise _refuse("--dp", f"--dp {layout.dp} and --gpus {gpus} disagree: {gpus} GPUs / ({sizes}) = DP {dp}",
                          "give one of them")
        cfg.data_parallel_size = dp
        return f"{gpus} GPUs ({source}): DP = {gpus} / ({sizes}) = {dp}"
    if layout.dp is not None:
        return f"{layout.dp * per_replica} GPUs: DP {layout.dp} (--dp) x {sizes}"
    if function is not None:
        raise _refuse("--gpus", f"{function}'s name states no GPU count, and neither --gpus nor --dp was given, so "
                      "the data-parallel size is unknown", "give the run's world size, e.g. --gpus "
                      f"{per_replica * 8}, or its data-parallel size, e.g. --dp 8")
    cfg.data_parallel_size = cfg.data_parallel_size or 1
    return (f"{cfg.data_parallel_size * per_replica} GPUs: DP {cfg.data_parallel_size} (the default without --gpus or "
            f"--dp) x {sizes}")


def _set_layout(cfg, layout: Layout, *, default_dp: Optional[int]) -> bool:
    """Set what ``layout`` gives; return whether sequence parallelism was left to the default (on with TP > 1)."""
    model = cfg.model
    sp_by_default = False
    for attr, value in (("tensor_model_parallel_size", layout.tp), ("pipeline_model_parallel_size", layout.pp),
                        ("expert_model_parallel_size", layout.ep), ("expert_tensor_parallel_size", layout.etp),
                        ("seq_length", layout.seq)):
        if value is not None:
            setattr(model, attr, value)
    if layout.seq is not None and hasattr(getattr(cfg, "dataset", None), "seq_length"):
        cfg.dataset.seq_length = layout.seq  # the training length: Bridge requires the model's and the data's to match
    if layout.sequence_parallel is not None:
        model.sequence_parallel = layout.sequence_parallel
    elif layout.tp is not None or default_dp is not None:  # the user chose TP (or a config.json): SP follows it
        model.sequence_parallel = sp_by_default = model.tensor_model_parallel_size > 1
    if layout.micro_batch is not None:
        cfg.train.micro_batch_size = layout.micro_batch
    dp = layout.dp or _dp_of_gpus(layout.gpus, model) or getattr(cfg, "data_parallel_size", None) or default_dp
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
    return sp_by_default


def _dp_of_gpus(gpus: Optional[int], model) -> Optional[int]:
    """DP for ``gpus`` GPUs at the sizes set so far (the global batch's default needs it before the overrides;
    :func:`data_parallel` sets the final one, or refuses a count the sizes do not divide)."""
    per_replica = model.tensor_model_parallel_size * model.pipeline_model_parallel_size * (model.context_parallel_size or 1)
    return gpus // per_replica if gpus and gpus % per_replica == 0 else None


def _layout_peft_object(layout: Layout):
    from megatron_bridge_ext.peft import kinds

    return kinds.bridge_class(layout.peft)(target_modules=kinds.target_names(layout.peft, layout.lora_targets),
                                           dim=layout.lora_dim, alpha=layout.lora_alpha)


def _peft_keys(overrides) -> set[str]:
    from megatron_bridge_ext import overrides as checks

    return {o.key_or_group.partition(".")[2] for o in checks.parse(overrides)
            if o.key_or_group.startswith("peft.")}


def _appended_peft_keys(overrides) -> set[str]:
    """The peft keys the user adds with ``+`` (Hydra's append, which needs the key absent): ours leave them out."""
    from megatron_bridge_ext import overrides as checks

    return {o.key_or_group.partition(".")[2] for o in checks.parse(overrides)
            if o.key_or_group.startswith("peft.") and o.is_add()} if overrides else set()


def _touches_peft(overrides) -> bool:
    return bool(overrides) and bool(_peft_keys(overrides))


def _layout_peft_overrides(layout: Layout, overrides, *, fields_first: bool = False) -> list[str]:
    """``--peft``'s PEFT as overrides (``++``: they set or add), less the keys the user's overrides set; with
    ``fields_first`` every field (the user's overrides follow and change them), less ``_target_`` when theirs
    names a class and less the keys theirs add with ``+`` (an append needs the key absent).

    The user naming one of our fields (``sequence_parallel_input_strategy``) asks for our class.
    """
    from megatron_bridge_ext import overrides as checks
    from megatron_bridge_ext.peft import kinds

    theirs = _peft_keys(overrides) if overrides else set()
    ours = bool(theirs & {"sequence_parallel_input_strategy", "sequence_parallel_input_regather"})
    cls = kinds.our_class(layout.peft) if ours else kinds.bridge_class(layout.peft)
    values = {"_target_": kinds.public_target(layout.peft) if ours else f"{cls.__module__}.{cls.__name__}",
              "target_modules": kinds.target_names(layout.peft, layout.lora_targets),
              "dim": layout.lora_dim, "alpha": layout.lora_alpha}
    dropped = ({"_target_"} & theirs) | _appended_peft_keys(overrides) if fields_first else theirs
    return [f"++peft.{k}={checks.hydra_value(v)}" for k, v in values.items() if k not in dropped]


def _with_overrides(cfg, overrides):
    if not overrides:
        return cfg
    import megatron_bridge_ext.peft.lora  # noqa: F401  (lets Bridge's override parser build our LoRA)
    from megatron_bridge_ext import overrides as checks

    try:
        from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    except ImportError as error:
        raise _refuse("overrides", f"Bridge's override parser is not importable ({_first_line(error)})",
                      "install hydra-core, or pass no overrides") from None
    checks.check_paths(cfg, overrides)
    with _bridge_warnings() as warned:
        try:
            cfg = process_config_with_overrides(cfg, cli_overrides=list(overrides))
        except Exception as error:  # Hydra and OmegaConf raise many kinds for a bad override
            raise _refuse("overrides", f"{' '.join(overrides)}: {type(error).__name__}: {_first_line(error)}",
                          _override_fix(cfg, error)) from None
    checks.check_built(cfg)
    if warned:
        raise _refuse("overrides", f"Bridge's override parser did not apply everything: {_first_line(warned[0])}",
                      "correct that override")
    return cfg


_FAILED_KEY = re.compile(r"override '([^']+)'")


def _override_fix(cfg, error) -> str:
    """The working form of the override Hydra names in ``error`` (:func:`..overrides.working_form`), or the general
    rule where it names none."""
    from megatron_bridge_ext import overrides as checks

    match = _FAILED_KEY.search(str(error))
    if match is None:
        return "write overrides as key=value (model.seq_length=8192), +key=value to add a key to a dict field"
    return checks.working_form(cfg, match.group(1).lstrip("+"))


@contextlib.contextmanager
def _bridge_warnings():
    """The warnings Bridge's override parser logs while the block runs (each one an override it skipped), kept
    from the log: the caller turns them into one refusal."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("megatron.bridge.training.utils.omegaconf_utils")
    handler, propagate = Keep(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _recipe_failed(spec: str, error: Exception) -> Refused:
    """A recipe function that raised, citing the line that raised. A ``NotImplementedError`` is the recipe refusing
    itself (Bridge ships some so, e.g. a PEFT recipe of a model whose PEFT it does not support): no input given here
    changes it; any other error is most often the recipe's read of its Hugging Face config."""
    what = f"{type(error).__name__}: {_first_line(error).rstrip(".")} ({_raised_at(error)})"
    if isinstance(error, NotImplementedError):
        return _refuse("--recipe", f"{spec}() refuses to build, as Bridge ships it: {what}",
                       "estimate another recipe of the model")
    return _refuse("--recipe", f"{spec}() failed: {what}",
                   "recipes that fetch a Hugging Face config need the hub; offline, add --hf-config with the model's "
                   "config.json")


def _raised_at(error: BaseException) -> str:
    """Where ``error`` was raised: the innermost frame's file (from its ``megatron/`` folder when it has one) and
    line."""
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    path = frame.filename.replace(os.sep, "/")
    path = path[path.rfind("/megatron/") + 1:] if "/megatron/" in path else os.path.basename(path)
    return f"{path} L{frame.lineno}"


def _first_line(error) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
