"""``mbx plan``'s checks of what the user asked for that need no Bridge: the overrides' syntax and values,
a flag and an override that set one field, a flag that cannot act, whole numbers and shares, the device and
its overrides, the plot's folder, the recipe's module.

Each returns one :class:`~megatron_bridge_ext.findings.Finding` (the first problem) or None, and runs before
torch or Bridge is imported, so a typo is answered in about a second instead of after the imports.
``--hf-config``'s checks against config.json are :mod:`.plan_hf_inputs`; the checks of the built config
are :mod:`megatron_bridge_ext.plan_config`'s (:func:`seq_note`, a note rather than a refusal, is here).
"""

from __future__ import annotations

import importlib.machinery
import os
from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding, Refused

FLAG_FIELDS = {"tp": "model.tensor_model_parallel_size", "pp": "model.pipeline_model_parallel_size",
               "ep": "model.expert_model_parallel_size", "etp": "model.expert_tensor_parallel_size",
               "seq": "model.seq_length", "micro_batch": "train.micro_batch_size",
               "global_batch": "train.global_batch_size", "sp": "model.sequence_parallel"}
"""Each flag that sets a config field, and the field as an override names it."""
SIZE_FIELDS = {"model.tensor_model_parallel_size": (2, False), "model.pipeline_model_parallel_size": (2, False),
               "model.context_parallel_size": (2, False), "model.expert_model_parallel_size": (4, False),
               "model.expert_tensor_parallel_size": (1, True), "model.virtual_pipeline_model_parallel_size": (2, True),
               "model.seq_length": (4096, False), "train.micro_batch_size": (1, False),
               "train.global_batch_size": (128, False)}
"""The whole-number fields an override may set, each to 1 or more, with an example; True: null (unset) is
allowed too."""
PEFT_KINDS = ("lora", "dora", "canonical_lora")
POSITIVE_INTS = {"tp": 2, "pp": 2, "dp": 8, "gpus": 16, "ep": 4, "etp": 1, "seq": 4096, "micro_batch": 1, "global_batch": 128,
                 "lora_dim": 32}
"""The whole-number options, each 1 or more (checked before anything is imported), with an example value."""
GPU_OVERRIDES = {"gpu_flops": ("bf16_flops", 1e12, 989.5), "gpu_hbm": ("hbm", 1e12, 3.35),
                 "gpu_nvlink": ("nvlink", 1e9, 450), "gpu_ib": ("ib", 1e9, 50)}
"""The device overrides: the :class:`~megatron_bridge_ext.levers.steptime.Gpu` field each sets, its unit in
the flag, and an example value (H100 SXM's)."""


def _bad(setting: str, message: str, fix: str) -> Finding:
    return Finding("bad_input", ERROR, setting, message, fix)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parsed_overrides(overrides) -> tuple[list, Optional[Finding]]:
    """Hydra's parse of the overrides (no Bridge needed), or the first one it cannot parse."""
    from megatron_bridge_ext import overrides as checks

    try:
        parsed = checks.parse(overrides or ())
    except Refused as refused:
        return [], refused.findings[0]
    empty = next((o for o in parsed if not o.key_or_group), None)
    if empty is not None:
        return [], _bad("overrides", f"{empty.input_line!r} names no field before '='",
                        "write key=value, e.g. model.seq_length=8192")
    return parsed, None


def override_problem(overrides) -> Optional[Finding]:
    """An override Hydra cannot parse, or a size field given a value that is not a whole number of 1 or more."""
    parsed, problem = parsed_overrides(overrides)
    if problem:
        return problem
    for override in parsed:
        key = override.key_or_group
        if key not in SIZE_FIELDS or override.is_delete():
            continue
        value, (example, nullable) = override.value(), SIZE_FIELDS[key]
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return _bad(key, f"{value!r} is not a whole number of 1 or more",
                        f"give e.g. {key}={example}" + (f", or {key}=null to leave it unset" if nullable else ""))
    return None


def conflict_problem(args) -> Optional[Finding]:
    """A flag and an override that give one field different values (the override would win unsaid)."""
    parsed, _ = parsed_overrides(args.overrides)
    last = {o.key_or_group: o for o in parsed if not o.is_delete()}
    for name, field in FLAG_FIELDS.items():
        flag_value, override = getattr(args, name, None), last.get(field)
        if flag_value is None or override is None or override.value() == flag_value:
            continue
        flag = _flag(name) if name != "sp" else ("--sp" if flag_value else "--no-sp")
        shown = "" if name == "sp" else f" {flag_value}"
        return _bad(field, f"{flag}{shown} and {override.input_line} set the same field to different values",
                    f"give one of them (drop {flag} or the override)")
    return None


def lora_dim_problem(args) -> Optional[Finding]:
    """``--lora-dim`` without a LoRA-family ``--peft``: no adapter would take the rank. A recipe without ``--peft``
    keeps its own PEFT, known once built (:func:`megatron_bridge_ext.plan_config.built_problem`)."""
    if args.lora_dim is None or args.peft in PEFT_KINDS or (args.peft is None and getattr(args, "recipe", None)):
        return None
    given = "--peft none adds no adapter" if args.peft else "no --peft was given"
    return _bad("--lora-dim", f"sets the rank of the adapters --peft adds, and {given} (every parameter trained)",
                "add --peft lora (or dora, canonical_lora), or drop --lora-dim")


def number_problem(args):
    """A whole-number option below 1, a load below 1, or a margin outside [0, 1)."""
    for name, example in POSITIVE_INTS.items():
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            return _bad(flag, f"{value} is not a whole number of 1 or more", f"give e.g. {flag} {example}")
    if args.moe_imbalance is not None:
        from megatron_bridge_ext.estimate.configs import imbalance_problem

        problem = imbalance_problem(args.moe_imbalance, "--moe-imbalance")
        if problem:
            return problem
    if args.margin is not None and not 0 <= args.margin < 1:
        return _bad("--margin", f"{args.margin} is not a share between 0 and 1", "give e.g. 0.10")
    return None


def search_problem(args):
    """``--search`` without ``--gpus``: the search spreads the workload over a world size the user states, never one
    taken from the config's layout in silence."""
    if getattr(args, "search", False) and not args.gpus:
        return _bad("--gpus", "--search looks for the best layout on a number of GPUs, and none was given",
                    "give --gpus N, the GPUs the run will have (e.g. --gpus 16)")
    return None


def gpu_problem(args):
    """An unknown --gpu or a device override that is not a positive number; else sets ``args.device``."""
    from megatron_bridge_ext.levers import steptime

    overrides = {}
    for name, (field, unit, example) in GPU_OVERRIDES.items():
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if value is not None and not value > 0:
            return _bad(flag, f"{value} is not a positive rate", f"give e.g. {flag} {example}")
        overrides[field] = None if value is None else value * unit
    try:
        args.device = steptime.gpu(args.gpu or steptime.DEFAULT_GPU, **overrides)
    except steptime.UnknownGpu as error:
        return _bad("--gpu", str(error), f"give one of them, e.g. --gpu {steptime.DEFAULT_GPU}")
    return None


def plot_problem(path: Optional[str]) -> Optional[Finding]:
    """A ``--plot`` file that could not be written: its folder missing or read-only, or the path a folder."""
    if path is None:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return _bad("--plot", f"{path} is a folder", "give a file name, e.g. --plot plan.png")
    if not os.path.isdir(folder):
        return _bad("--plot", f"folder {folder} does not exist", "create it, or give a file in an existing folder")
    if not os.access(folder, os.W_OK):
        return _bad("--plot", f"folder {folder} is not writable", "give a file in a folder you can write")
    return None


def recipe_module_problem(spec: Optional[str]) -> Optional[Finding]:
    """A ``--recipe`` whose module is not on the path, found without importing it (no Bridge import).

    Each package of the dotted name is looked up in its parent's folders, so no ``__init__`` runs; the
    function's name is checked once the module is imported (a module may define it in many ways).
    """
    if not spec:
        return None
    module, _, function = spec.partition(":")
    if not module or not function:
        return None  # the build refuses it by its form, with an example
    path = None
    for depth, part in enumerate(module.split(".")):
        found = importlib.machinery.PathFinder.find_spec(part, path)
        if found is None:
            name = ".".join(module.split(".")[:depth + 1])
            return _bad("--recipe", f"cannot import {module!r} (no module named {name!r})",
                        "give an importable recipe module")
        path = found.submodule_search_locations
        if path is None and depth < module.count("."):
            return _bad("--recipe", f"cannot import {module!r} ({found.name!r} is a module, not a package)",
                        "give an importable recipe module")
    return None


def seq_note(seq_length, hf_config: Optional[str]) -> Optional[str]:
    """A note when the training sequence is longer than config.json's ``max_position_embeddings``."""
    if not hf_config:
        return None
    from megatron_bridge_ext.estimate.configs import read_hf_config, text_fields

    longest = text_fields(read_hf_config(hf_config)).get("max_position_embeddings")
    if not isinstance(longest, int) or not isinstance(seq_length, int) or seq_length <= longest:
        return None
    return (f"seq {seq_length} is longer than config.json's max_position_embeddings {longest}, the longest "
            "sequence the model was built for (its position embeddings or RoPE scaling may not reach it)")
