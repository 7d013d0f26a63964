"""What the allocator setup would change, decided from an environment without touching it.

Pure: an environment (a mapping) and the torch version in, an :class:`AllocatorPlan` out. Every
way in (``init()``, ``mbx run``, a Bridge config's ``env_vars``) and every check before launch
(``MemoryConfig.validate``, ``mbx env``) uses these functions, so they all agree on what would be
written and why.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping, Optional

from megatron_bridge_ext.levers.allocator import guards
from megatron_bridge_ext.levers.allocator.guards import IPC_ENV, NCCL_GRAPH_REGISTER
from megatron_bridge_ext.levers.allocator.options import VARIABLES, AllocConf, parse_version, precedence_for
from megatron_bridge_ext.findings import ERROR, WARNING, Finding

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass
class AllocatorPlan:
    """What setup would change (name -> (old, new)) and what the guards found."""

    torch_version: str
    reader: str  # which variable this torch reads
    changes: dict[str, tuple[Optional[str], str]] = field(default_factory=dict)
    expandable_segments: bool = False  # configured on after the changes
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == ERROR]


def installed_torch_version() -> str:
    """The installed torch's version, read from its metadata (does not import torch)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"torch is not installed for {sys.executable}: megatron_bridge_ext needs it to know which allocator "
            "variable to write. Fix: install torch>=2.6, or pass torch_version='2.x.y'") from None


def ipc_flag(environ: Mapping[str, str]) -> bool:
    """``MBX_ALLOCATOR_IPC``: this process shares CUDA memory with others through IPC."""
    value = environ.get(IPC_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{IPC_ENV}={environ[IPC_ENV]!r} is not a yes/no value. Fix: set it to 1 or 0")


def plan_allocator(environ: Mapping[str, str], *, torch_version: str, nccl_ub: bool = False,
                   cuda_graph_impl: Optional[str] = None, ipc: bool = False) -> AllocatorPlan:
    """Decide what to write, run every guard; raises AllocatorConfigError on malformed options, ValueError on
    an unknown ``cuda_graph_impl``."""
    guards.check_cuda_graph_impl(cuda_graph_impl)
    tv = parse_version(torch_version)
    precedence = precedence_for(tv)
    plan = AllocatorPlan(torch_version, precedence.note)
    confs = {name: AllocConf.parse(environ[name], name) for name in VARIABLES if name in environ}
    for name, conf in confs.items():
        plan.findings += guards.conf_findings(name, conf)

    if precedence.write_all_set:
        targets = [n for n in precedence.read_order if n in confs] or [precedence.default_target]
    else:
        winner = next((n for n in precedence.read_order if n in confs), precedence.default_target)
        targets = [winner]
        for name in confs:
            if name != winner:
                plan.findings.append(guards.shadowed(name, environ[name], winner, winner in confs))
    target_confs = {t: confs.get(t, AllocConf()) for t in targets}
    primary = targets[0]

    flags = {t: c.flag("expandable_segments") for t, c in target_confs.items()}
    # An explicit expandable_segments:False anywhere is the user's choice, even in a variable torch ignores.
    disabled_in = next((n for n, c in confs.items() if c.flag("expandable_segments") is False), None)
    user_expandable = False if disabled_in else (True if True in flags.values() else None)
    async_in = next((t for t, c in target_confs.items() if c.get("backend") == "cudaMallocAsync"), None)

    want = False
    if disabled_in:
        plan.findings.append(guards.user_disabled(disabled_in))
    elif async_in:
        plan.findings.append(guards.cuda_malloc_async(async_in, user_expandable))
    elif ipc:
        plan.findings.append(guards.ipc(primary, user_expandable))
        want = bool(user_expandable)
    else:
        want = True
    plan.expandable_segments = want

    if want:
        if nccl_ub:
            finding = guards.nccl_ub(tv, user_set=bool(user_expandable))
            if finding:
                plan.findings.append(finding)
        if cuda_graph_impl not in (None, "none"):
            current = environ.get(NCCL_GRAPH_REGISTER)
            value, finding = guards.cuda_graphs(cuda_graph_impl, None if current is None else str(current))
            if value is not None:
                plan.changes[NCCL_GRAPH_REGISTER] = (None, value)
            if finding:
                plan.findings.append(finding)
        for name, conf in target_confs.items():
            finding = guards.max_split_size(name, conf)
            if finding:
                plan.findings.append(finding)
            if flags[name] is not True:
                plan.changes[name] = (environ.get(name), conf.with_option("expandable_segments", "True").render())
        _mirror_into_first_read(plan, precedence, environ, target_confs)
    return plan


def _mirror_into_first_read(plan: AllocatorPlan, precedence, environ, target_confs) -> None:
    """Torch >= 2.12: the user's options in PYTORCH_ALLOC_CONF also go into the unset PYTORCH_CUDA_ALLOC_CONF.

    Torch reads PYTORCH_CUDA_ALLOC_CONF first whenever it is set, so a value set later by someone
    else (a Bridge recipe's env_vars, applied with setdefault) would hide the user's options.
    """
    first = precedence.read_order[0]
    if precedence.write_all_set or first in environ or len(precedence.read_order) < 2:
        return
    source = precedence.read_order[1]
    conf = target_confs.get(source)
    if conf is None or not [k for k in conf.keys() if k != "expandable_segments"]:
        return  # nothing of the user's to protect
    plan.changes[first] = (None, conf.with_option("expandable_segments", "True").render())
    plan.findings.append(guards.mirrored(source, first))


def _carry_shell_options(view: dict, recipe: Mapping[str, str], shell: Mapping[str, str], precedence):
    """A recipe variable that torch reads first hides the user's shell variable: merge the shell's options in.

    Returns (shell variable, recipe variable) when it merged, else None. Shell options win on duplicate keys.
    """
    if precedence.write_all_set or len(precedence.read_order) < 2:
        return None
    first, second = precedence.read_order[:2]
    if not (first in recipe and first not in shell and second in shell):
        return None
    merged = AllocConf.parse(recipe[first], f"cfg.env_vars {first}")
    for option in AllocConf.parse(shell[second], second).options:
        merged = merged.with_option(option.key, option.value)
    view[first] = merged.render()
    return second, first


def plan_bridge_env(cfg, *, ipc: Optional[bool] = None, environ: Optional[MutableMapping[str, str]] = None,
                    torch_version: Optional[str] = None) -> AllocatorPlan:
    """What the setup would write into a Bridge ``ConfigContainer``'s ``env_vars``; changes nothing.

    Bridge 0.6.2 applies ``cfg.env_vars`` with ``os.environ.setdefault`` (training/config.py,
    ``apply_environment_variables``, first step of ``runtime_config_update``): a value already in
    the shell wins. So the plan is made on what Bridge will end up with (env_vars under the shell),
    and a shell value that differs from what we need is reported with the fix. The guards read
    ``cfg.ddp.nccl_ub`` and ``cfg.model.cuda_graph_impl``.
    """
    env = os.environ if environ is None else environ
    recipe = {k: str(v) for k, v in (getattr(cfg, "env_vars", None) or {}).items()}
    view = dict(recipe)
    view.update(env)
    version = torch_version or installed_torch_version()
    carried = _carry_shell_options(view, recipe, env, precedence_for(parse_version(version)))
    plan = plan_allocator(
        view, torch_version=version,
        nccl_ub=bool(getattr(getattr(cfg, "ddp", None), "nccl_ub", False)),
        cuda_graph_impl=getattr(getattr(cfg, "model", None), "cuda_graph_impl", None),
        ipc=ipc_flag(view) if ipc is None else ipc)
    if carried:
        source, target = carried
        plan.findings = [f for f in plan.findings if not (f.code == "shadowed" and f.setting == source)]
        plan.findings.append(guards.carried(source, target))
        if target not in plan.changes:  # the recipe already had expandable_segments:True
            plan.changes[target] = (recipe[target], view[target])
    for name, (_, new) in plan.changes.items():
        if name in env and env[name] != new:
            plan.findings.append(Finding(
                "shell_wins", WARNING, name,
                f"is {env[name]!r} in the shell; Bridge applies cfg.env_vars with os.environ.setdefault, so the "
                f"shell value wins and {new!r} from cfg.env_vars is not applied.",
                f"export {name}={new!r} in the launch script, or call megatron_bridge_ext.init() first"))
    if plan.changes and not _applies_env_vars(cfg):
        plan.findings.append(Finding(
            "bridge_ignores_env_vars", WARNING, "cfg.env_vars",
            "this Megatron Bridge's ConfigContainer has no env_vars field (added in Bridge 0.6), so Bridge never "
            f"applies the allocator variables written there ({', '.join(plan.changes)}).",
            "call megatron_bridge_ext.init() first in the training script, or launch with `mbx run -- torchrun ...`"))
    return plan


def _applies_env_vars(cfg) -> bool:
    """Whether Bridge applies ``cfg.env_vars``: a field of its ConfigContainer (Bridge >= 0.6), not a stray attribute."""
    return not dataclasses.is_dataclass(cfg) or any(f.name == "env_vars" for f in dataclasses.fields(cfg))
