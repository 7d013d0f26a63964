"""Apply the allocator plan: to this process (``init()``), to a command's environment (``mbx run``),
or to a Bridge ``ConfigContainer``'s ``env_vars``.

Each way in plans with :mod:`.env_plan`, refuses with :class:`~megatron_bridge_ext.findings.Refused`
before changing anything when a guard says the run cannot work, then writes and logs every change
with its old and new value.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, MutableMapping, Optional

from megatron_bridge_ext.levers.allocator import runtime
from megatron_bridge_ext.levers.allocator.options import VARIABLES, effective, parse_version
from megatron_bridge_ext.levers.allocator.env_plan import (
    AllocatorPlan,
    installed_torch_version,
    ipc_flag,
    plan_allocator,
    plan_bridge_env,
)
from megatron_bridge_ext.findings import ACTION, ERROR, WARNING, Finding, Refused

log = logging.getLogger("megatron_bridge_ext.levers.allocator")

WHAT = "allocator setup"


@dataclass
class AllocatorResult:
    """What setup applied (old/new values) and what it found."""

    torch_version: str
    reader: str
    applied: str  # "environment" | "runtime" | "bridge_env_vars" | "unchanged"
    changes: dict[str, tuple[Optional[str], str]]
    expandable_segments: bool
    findings: list[Finding]
    torch_imported: bool = False
    cuda_initialized: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["changes"] = {k: {"old": o, "new": n} for k, (o, n) in self.changes.items()}
        return data


def setup_allocator(environ: Optional[MutableMapping[str, str]] = None, *, nccl_ub: bool = False,
                    cuda_graph_impl: Optional[str] = None, ipc: Optional[bool] = None,
                    torch_version: Optional[str] = None) -> AllocatorResult:
    """Turn on expandable segments in ``environ`` (default: this process) and check the guards.

    ``ipc=None`` reads ``MBX_ALLOCATOR_IPC``. On this process's environment, if torch has
    already initialised CUDA, the new settings are applied through torch's run-time setter
    (only segments reserved afterwards are affected) or, where torch has none, refused with
    how to call this earlier. Raises :class:`Refused` on error findings, before changing anything.
    """
    live = environ is None or environ is os.environ
    env = os.environ if environ is None else environ
    version = torch_version or installed_torch_version()
    plan = plan_allocator(env, torch_version=version, nccl_ub=nccl_ub, cuda_graph_impl=cuda_graph_impl,
                          ipc=ipc_flag(env) if ipc is None else ipc)
    torch_imported = live and runtime.torch_imported()
    cuda_initialized = torch_imported and runtime.cuda_initialized()
    alloc_changed = any(name in VARIABLES for name in plan.changes)
    setter = setter_name = None
    if torch_imported and alloc_changed:
        setter, setter_name = runtime.setter()
        if cuda_initialized and setter is None:
            plan.findings.append(Finding(
                "cuda_initialized", ERROR, "expandable_segments",
                f"CUDA is already initialised and torch {version} has no run-time allocator setter.", runtime.EARLIER))
    if plan.errors:
        raise Refused(WHAT, plan.errors)

    for name, (_, new) in plan.changes.items():
        env[name] = new
    applied = "environment" if plan.changes else "unchanged"
    if setter is not None:
        applied = _apply_running(env, version, setter, setter_name, cuda_initialized, plan) or applied
    result = AllocatorResult(version, plan.reader, applied, plan.changes, plan.expandable_segments,
                             plan.findings, torch_imported, cuda_initialized)
    _log(result, live)
    return result


def _apply_running(env, version: str, setter: Callable[[str], None], setter_name: str, cuda_initialized: bool,
                   plan: AllocatorPlan) -> Optional[str]:
    """torch is imported: hand the settings to it if it already read the old ones."""
    value = effective(env, parse_version(version))[1].render()
    if not cuda_initialized:
        get = runtime.getter()
        # The getter parses the variables now if torch has not yet; a different answer means it read them earlier.
        if get is None or get() == value:
            return None
    setter(value)
    plan.findings.append(Finding(
        "runtime", WARNING, "expandable_segments",
        f"applied at run time through {setter_name}({value!r}) because "
        + ("CUDA was already initialised" if cuda_initialized else "torch had already read the allocator settings")
        + ": memory reserved before this call stays in its old segments.", runtime.EARLIER))
    return "runtime"


def _log(result: AllocatorResult, live: bool = False) -> None:
    when = {"environment": "before CUDA initialisation" if live else "in the environment of the command",
            "runtime": "at run time", "bridge_env_vars": "into cfg.env_vars", "unchanged": ""}[result.applied]
    for name, (old, new) in result.changes.items():
        log.info("%s: %s -> %r (%s)", name, "unset" if old is None else repr(old), new, when)
    if not result.changes:
        log.info("allocator: nothing to change (expandable_segments %s)", "on" if result.expandable_segments else "off")
    for finding in result.findings:
        (log.info if finding.level == ACTION else log.warning)("%s", finding.text())


def init(*, nccl_ub: bool = False, cuda_graph_impl: Optional[str] = None, ipc: Optional[bool] = None) -> AllocatorResult:
    """The first call of a training script: set up the allocator of this process.

    Shows our INFO lines when the script has not configured logging itself.
    """
    if not logging.getLogger().handlers:
        from megatron_bridge_ext import logs

        logs.configure()
    return setup_allocator(nccl_ub=nccl_ub, cuda_graph_impl=cuda_graph_impl, ipc=ipc)


def bridge_env_findings(cfg, *, ipc: Optional[bool] = None, environ: Optional[MutableMapping[str, str]] = None,
                        torch_version: Optional[str] = None) -> tuple[AllocatorPlan, list[Finding]]:
    """The plan for ``cfg.env_vars`` and its findings, with a refusal when CUDA already runs here."""
    plan = plan_bridge_env(cfg, ipc=ipc, environ=environ, torch_version=torch_version)
    findings = list(plan.findings)
    if environ is None or environ is os.environ:
        late = runtime.cuda_initialized_finding(
            "cfg.env_vars", "allocator variables that Bridge applies now have no effect.")
        if late:
            findings.append(late)
    return plan, findings


def configure_bridge_env(cfg, *, ipc: Optional[bool] = None, environ: Optional[MutableMapping[str, str]] = None,
                         torch_version: Optional[str] = None) -> AllocatorResult:
    """Fill a Bridge ``ConfigContainer``'s ``env_vars`` with the allocator settings (see :func:`.plan.plan_bridge_env`).

    Raises :class:`Refused` when a guard refuses, before changing anything.
    """
    plan, findings = bridge_env_findings(cfg, ipc=ipc, environ=environ, torch_version=torch_version)
    refused = [f for f in findings if f.level == ERROR]
    if refused:
        raise Refused(WHAT, refused)
    if getattr(cfg, "env_vars", None) is None:
        cfg.env_vars = {}
    for name, (_, new) in plan.changes.items():
        cfg.env_vars[name] = new
    result = AllocatorResult(plan.torch_version, plan.reader, "bridge_env_vars" if plan.changes else "unchanged",
                             plan.changes, plan.expandable_segments, findings)
    _log(result)
    return result
