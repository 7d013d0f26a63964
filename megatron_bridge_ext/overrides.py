"""Bridge's Hydra-style overrides, checked where Bridge's own parser would silently do nothing.

Bridge's parser (``megatron.bridge.training.utils.omegaconf_utils.process_config_with_overrides``)
turns the run config into an OmegaConf tree and back. Three things it lets pass without an error:

* ``+key=value`` on a name the config does not have: the tree takes the key, then Bridge logs
  "not found ... Skipping" and the run goes on without it (a typo such as ``+model.num_layerz``);
* any override under a field it leaves out of the tree: values it treats as callables, which
  include every PEFT object (``peft(model)``). It puts the object back after the overrides, so
  ``+peft._target_=...`` on a recipe that sets ``cfg.peft`` changes nothing;
* a ``_target_`` it cannot build (a bad value, an unknown field, a package not on its allowlist):
  it logs a warning and leaves the plain dict in the config.

:func:`check_paths` refuses the first two before the parser runs, naming the closest field;
:func:`check_built` refuses the third after it, with the class's own error. Both raise
:class:`~megatron_bridge_ext.findings.Refused` (one line per problem, with its fix).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Mapping
from typing import Any, Iterable, Optional

from megatron_bridge_ext.findings import ERROR, Finding, Refused

WHAT = "overrides"

PEFT_OBJECT_REASON = ("Bridge's override parser leaves a PEFT object out of the override config (it is callable) and "
                      "puts it back after the overrides")
"""Why no override can change a ``cfg.peft`` that a recipe or script set in Python."""


def _refuse(setting: str, message: str, fix: str, code: str = "bad_override") -> Refused:
    return Refused(WHAT, [Finding(code, ERROR, setting, message, fix)])


def parse(overrides: Iterable[str]) -> list:
    """Hydra's parse of ``overrides`` (key, kind of override, value), or Refused naming the bad string."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException
    except ImportError as error:
        raise _refuse("overrides", f"hydra-core is not importable ({error}); Bridge's override parser needs it.",
                      "pip install hydra-core, or pass no overrides") from None

    try:
        return OverridesParser.create().parse_overrides(overrides=list(overrides))
    except HydraException as error:
        text = str(error).strip().splitlines()
        raise _refuse("overrides", text[0] if text else type(error).__name__,
                      "write overrides as key=value (model.seq_length=8192), +key=value to add a key to a dict "
                      "field") from None


def hydra_value(value: Any) -> str:
    """``value`` as an override writes it: null, true/false, [a,b]; a string as it is."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return str(value)


def _field_names(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _no_such_field(path: str, name: str, names: list[str], owner: str) -> Refused:
    close = difflib.get_close_matches(name, names, n=1)
    parent = path.rpartition(".")[0]
    if close:
        fix = f"did you mean {parent + '.' if parent else ''}{close[0]}?"
    else:
        fix = f"use a field of {owner} ({', '.join(names[:12])}{', ...' if len(names) > 12 else ''})"
    return _refuse(path, f"no such field of {owner}.", fix, "no_such_field")


def check_paths(cfg, overrides: Iterable[str]) -> None:
    """Refuse an override whose key names no field of ``cfg``, or a field Bridge leaves out of overrides.

    With or without ``+``: a new key is only meaningful in a dict field (``env_vars``), or under a
    field that is None and that the overrides create with ``_target_`` (then the target's fields).
    """
    from megatron.bridge.training.utils.omegaconf_utils import create_omegaconf_dict_config

    parsed = parse(overrides)
    _, excluded = create_omegaconf_dict_config(cfg)
    left_out = {path.removeprefix("root.") for path in excluded}
    targets = {o.key_or_group.rpartition(".")[0]: o.value() for o in parsed
               if o.key_or_group.endswith("._target_") and not o.is_delete()}
    for override in parsed:
        _check_path(cfg, override, left_out, targets)


def _check_path(cfg, override, left_out: set[str], targets: dict[str, Any]) -> None:
    key = override.key_or_group
    obj, walked = cfg, []
    for name in key.split("."):
        path = ".".join([*walked, name])
        if path in left_out:
            kind = type(getattr(obj, name)).__name__
            raise _refuse(path, f"{override.input_line} changes nothing: cfg.{path} is a {kind} object set in "
                                f"Python, and {PEFT_OBJECT_REASON if path == 'peft' else _LEFT_OUT_REASON}.",
                          _left_out_fix(path, key), "override_cannot_reach")
        if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
            break  # a dict, or None that the overrides fill: Hydra and the _target_ check judge it
        if name not in _field_names(obj):
            raise _no_such_field(path, name, _field_names(obj), type(obj).__name__)
        obj, walked = getattr(obj, name), [*walked, name]
    else:
        return
    parent = ".".join(walked)
    if obj is None and parent in targets and name != "_target_":
        _check_target_field(parent, targets[parent], key.rpartition(".")[2])


_LEFT_OUT_REASON = "Bridge's override parser leaves callables out of the override config and puts them back afterwards"


STRATEGY_KEYS = ("peft._target_", "peft.sequence_parallel_input_strategy")
"""The PEFT overrides that switch on our LoRA-A input strategy, which MemoryConfig does on a recipe's PEFT object."""


def _left_out_fix(path: str, key: str) -> str:
    """How to make the change the override meant: the strategy by MemoryConfig, another PEFT field where the recipe
    builds the object (``cfg.peft.dim = 64``), or ``--peft`` building Bridge's own in its place."""
    if path != "peft":
        return f"set cfg.{path} in the training script"
    if key in STRATEGY_KEYS:
        return ("set it in the training script: "
                "megatron_bridge_ext.config.MemoryConfig(sequence_parallel_input_strategy=...).apply(cfg) "
                "switches a LoRA-family cfg.peft to ours with that strategy (mbx plan evaluates it as a lever)")
    return (f"set cfg.{key} in the training script where the recipe builds cfg.peft, or give --peft lora (with "
            "--lora-dim) to estimate Bridge's LoRA in its place")


def _locate(target: str):
    module_name, _, name = str(target).rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _check_target_field(parent: str, target: str, name: str) -> None:
    cls = _locate(target)
    if cls is None:
        raise _refuse(f"{parent}._target_", f"{target!r} is not an importable class.",
                      "name a class by its module path, e.g. megatron_bridge_ext.peft.LoRA")
    if dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if name not in names:
            raise _no_such_field(f"{parent}.{name}", name, names, f"{cls.__module__}.{cls.__qualname__}")


def check_built(cfg) -> None:
    """Refuse a ``cfg.peft`` that Bridge's parser left a dict: the class's own error, as one line."""
    finding = unbuilt_peft(cfg)
    if finding is not None:
        raise Refused(WHAT, [finding])


def unbuilt_peft(cfg) -> Optional[Finding]:
    """Why ``cfg.peft`` is still a dict with ``_target_`` (Bridge logged its failure and went on); None otherwise."""
    value = getattr(cfg, "peft", None)
    if not isinstance(value, Mapping) or "_target_" not in value:
        return None
    target = str(value["_target_"])
    kwargs = {k: v for k, v in value.items() if k != "_target_"}
    cls = _locate(target)
    if cls is None:
        return Finding("peft_not_built", ERROR, "peft._target_", f"{target!r} is not an importable class.",
                       "name a class by its module path, e.g. megatron_bridge_ext.peft.LoRA")
    try:
        cls(**kwargs)
    except Exception as error:  # noqa: BLE001  (the class decides what it refuses; we only report it)
        return _build_error(target, cls, kwargs, error)
    return Finding("peft_not_built", ERROR, "peft._target_",
                   f"Bridge did not build {target} (it left cfg.peft a dict); Bridge builds targets only from "
                   "packages on its allowlist.",
                   "import megatron_bridge_ext.peft before Bridge processes the overrides (it adds the package)")


def _build_error(target: str, cls, kwargs: dict, error: Exception) -> Finding:
    from megatron_bridge_ext.levers.lora_input.sp_lora import ChoiceError

    if isinstance(error, ChoiceError):
        field_name = error.setting.rpartition(".")[2]
        return Finding("bad_override_value", ERROR, f"peft.{field_name}",
                       f"{error.value!r} is not valid for {target}.", error.fix())
    names = [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else []
    unknown = [k for k in kwargs if names and k not in names]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        return Finding("no_such_field", ERROR, f"peft.{unknown[0]}", f"no such field of {target}.",
                       f"did you mean peft.{close[0]}?" if close else f"use a field of {target}")
    first = str(error).strip().splitlines()
    return Finding("peft_not_built", ERROR, "peft", f"{target} refused the overrides: "
                   f"{first[0] if first else type(error).__name__}", "correct the peft.* overrides")


def working_form(cfg, key: str) -> str:
    """The form of an override that works for ``key`` on ``cfg``, as a "Fix:" line says it.

    A field under a None parent needs the parent built first (``--peft`` or ``++peft._target_=`` for ``peft``, a
    recipe name for ``mixed_precision``; ``++`` creates any other); a new key of a dict field needs ``+``;
    a field that exists takes ``key=value``.
    """
    obj, walked = cfg, []
    for name in key.split(".")[:-1]:
        walked.append(name)
        parent = ".".join(walked)
        value = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if value is None:
            return _none_parent_form(parent, key)
        if isinstance(value, Mapping):
            return f"write +{key}=VALUE to add a key to the dict {parent} (++{key}=VALUE sets or adds it)"
        obj = value
    return f"write {key}=VALUE (the field exists: no + or ++)"


def _none_parent_form(parent: str, key: str) -> str:
    if parent == "peft":
        return (f"give mbx plan --peft lora (or dora, canonical_lora) and then {key}=VALUE, or build it with "
                f"++peft._target_=megatron.bridge.peft.lora.LoRA ++{key}=VALUE")
    if parent == "mixed_precision":
        return f"name the recipe first: mixed_precision=bf16_mixed {key}=VALUE"
    return f"{parent} is None here: write ++{key}=VALUE (++ creates it), or set {parent}._target_=CLASS first"
