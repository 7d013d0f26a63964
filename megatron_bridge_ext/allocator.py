"""Turn on PyTorch's expandable segments before CUDA starts, keeping every option the user set.

Why: most out-of-memory errors near the limit come from the caching allocator's fragmentation
(free memory held in segments that live blocks keep split), not from capacity. Expandable
segments remove most of it at no throughput cost. The option must be in place before CUDA is
initialised, must not clobber the user's options, and does not go with a few features; those
are checked here (:mod:`megatron_bridge_ext.allocator_guards`) before launch.

Three ways in, all backed by :func:`plan_allocator`:

* :func:`init` (``megatron_bridge_ext.init()``) as the first call of a training script;
* :func:`configure_bridge_env` fills a Bridge ``ConfigContainer.env_vars`` (Bridge applies them
  with ``os.environ.setdefault`` in ``runtime_config_update``, so shell values win);
* ``mbx run -- torchrun ...`` sets the environment, then executes the launcher.

Importing this module does not import torch (it must run before torch reads the variables);
which variable torch reads is explained in :mod:`megatron_bridge_ext.allocator_conf`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, MutableMapping, Optional

from megatron_bridge_ext import allocator_guards as guards
from megatron_bridge_ext.allocator_conf import (
    ALLOC_VAR,
    CUDA_VAR,
    VARIABLES,
    AllocConf,
    AllocatorConfigError,
    effective,
    parse_version,
    precedence_for,
)
from megatron_bridge_ext.allocator_guards import IPC_ENV, NCCL_GRAPH_REGISTER, Finding

__all__ = [
    "ALLOC_VAR", "CUDA_VAR", "AllocConf", "AllocatorConfigError", "AllocatorPlan", "AllocatorResult",
    "AllocatorSetupError", "AllocatorVerification", "Finding", "configure_bridge_env", "init",
    "describe_environment", "package_versions", "plan_allocator", "setup_allocator", "verify_allocator",
]

log = logging.getLogger("megatron_bridge_ext.allocator")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_EARLIER = ("call megatron_bridge_ext.init() as the first line of the training script (before anything "
            "touches CUDA), or launch with `mbx run -- torchrun ...`")


class AllocatorSetupError(RuntimeError):
    """The allocator cannot be set up as asked; the message names each setting and its fix."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("allocator setup refused:\n" + "\n".join(f"  - {f.text()}" for f in findings))


@dataclass
class AllocatorPlan:
    """What setup would change, computed from an environment without touching it."""

    torch_version: str
    reader: str  # which variable this torch reads
    changes: dict[str, tuple[Optional[str], str]] = field(default_factory=dict)  # name -> (old, new)
    expandable_segments: bool = False  # configured on after the changes
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]


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


# --------------------------------------------------------------------------------------------
# Planning (pure: environment in, plan out)
# --------------------------------------------------------------------------------------------


def installed_torch_version() -> str:
    """The installed torch's version, read from its metadata (does not import torch)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"torch is not installed for {sys.executable}: megatron_bridge_ext needs it to know which allocator "
            "variable to write. Fix: install torch>=2.6, or pass torch_version='2.x.y'") from None


def ipc_flag(environ: MutableMapping[str, str]) -> bool:
    """``MBX_ALLOCATOR_IPC``: this process shares CUDA memory with others through IPC."""
    value = environ.get(IPC_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{IPC_ENV}={environ[IPC_ENV]!r} is not a yes/no value. Fix: set it to 1 or 0")


def plan_allocator(environ, *, torch_version: str, nccl_ub: bool = False,
                   cuda_graph_impl: Optional[str] = None, ipc: bool = False) -> AllocatorPlan:
    """Decide what to write, run every guard; raises AllocatorConfigError on malformed options."""
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
    disabled_in = next((t for t, v in flags.items() if v is False), None)
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
            value, finding = guards.cuda_graphs(cuda_graph_impl, _str_or_none(environ.get(NCCL_GRAPH_REGISTER)))
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
    return plan


def _str_or_none(value) -> Optional[str]:
    return None if value is None else str(value)


# --------------------------------------------------------------------------------------------
# Applying
# --------------------------------------------------------------------------------------------


def setup_allocator(environ: Optional[MutableMapping[str, str]] = None, *, nccl_ub: bool = False,
                    cuda_graph_impl: Optional[str] = None, ipc: Optional[bool] = None,
                    torch_version: Optional[str] = None) -> AllocatorResult:
    """Turn on expandable segments in ``environ`` (default: this process) and check the guards.

    ``ipc=None`` reads ``MBX_ALLOCATOR_IPC``. On this process's environment, if torch has
    already initialised CUDA, the new settings are applied through torch's run-time setter
    (only segments reserved afterwards are affected) or, where torch has none, refused with
    how to call this earlier. Raises AllocatorSetupError on error findings, before changing anything.
    """
    live = environ is None or environ is os.environ
    env = os.environ if environ is None else environ
    version = torch_version or installed_torch_version()
    plan = plan_allocator(env, torch_version=version, nccl_ub=nccl_ub, cuda_graph_impl=cuda_graph_impl,
                          ipc=ipc_flag(env) if ipc is None else ipc)
    torch_imported = live and "torch" in sys.modules
    cuda_initialized = torch_imported and _cuda_initialized()
    alloc_changed = any(name in VARIABLES for name in plan.changes)
    setter = None
    if torch_imported and alloc_changed:
        setter, setter_name = _runtime_setter()
        if cuda_initialized and setter is None:
            plan.findings.append(Finding(
                "cuda_initialized", "error", "expandable_segments",
                f"CUDA is already initialised and torch {version} has no run-time allocator setter.", _EARLIER))
    if plan.errors:
        raise AllocatorSetupError(plan.errors)

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
        getter = _runtime_getter()
        # The getter parses the variables now if torch has not yet; a different answer means it read them earlier.
        if getter is None or getter() == value:
            return None
    setter(value)
    plan.findings.append(Finding(
        "runtime", "warning", "expandable_segments",
        f"applied at run time through {setter_name}({value!r}) because "
        + ("CUDA was already initialised" if cuda_initialized else "torch had already read the allocator settings")
        + ": memory reserved before this call stays in its old segments.", _EARLIER))
    return "runtime"


def _cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def _runtime_setter() -> tuple[Optional[Callable[[str], None]], Optional[str]]:
    import torch

    fn = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if fn is not None:
        return fn, "torch._C._accelerator_setAllocatorSettings"
    fn = getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)  # older torch
    if fn is not None:
        return fn, "torch.cuda.memory._set_allocator_settings"
    return None, None


def _runtime_getter() -> Optional[Callable[[], str]]:
    import torch

    return getattr(torch._C, "_accelerator_getAllocatorSettings", None)


def _log(result: AllocatorResult, live: bool = False) -> None:
    when = {"environment": "before CUDA initialisation" if live else "in the environment of the command",
            "runtime": "at run time", "bridge_env_vars": "into cfg.env_vars", "unchanged": ""}[result.applied]
    for name, (old, new) in result.changes.items():
        log.info("%s: %s -> %r (%s)", name, "unset" if old is None else repr(old), new, when)
    if not result.changes:
        log.info("allocator: nothing to change (expandable_segments %s)", "on" if result.expandable_segments else "off")
    for finding in result.findings:
        (log.warning if finding.level != "info" else log.info)("%s", finding.text())


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def init(*, nccl_ub: bool = False, cuda_graph_impl: Optional[str] = None, ipc: Optional[bool] = None) -> AllocatorResult:
    """The first call of a training script: set up the allocator of this process.

    Shows our INFO lines when the script has not configured logging itself.
    """
    if not logging.getLogger().handlers:
        from megatron_bridge_ext import logs

        logs.configure()
    return setup_allocator(nccl_ub=nccl_ub, cuda_graph_impl=cuda_graph_impl, ipc=ipc)


def plan_bridge_env(cfg, *, ipc: Optional[bool] = None, environ: Optional[MutableMapping[str, str]] = None,
                    torch_version: Optional[str] = None) -> AllocatorResult:
    """What :func:`configure_bridge_env` would write into ``cfg.env_vars``, changing and logging nothing.

    Bridge 0.6.2 applies ``cfg.env_vars`` with ``os.environ.setdefault`` (training/config.py,
    ``apply_environment_variables``, first step of ``runtime_config_update``): a value already
    in the shell wins. So the plan is made on what Bridge will end up with (env_vars under the
    shell), and a shell value that differs from what we need is reported with the fix. The
    guards read ``cfg.ddp.nccl_ub`` and ``cfg.model.cuda_graph_impl``. Raises
    :class:`AllocatorSetupError` when a guard refuses.
    """
    env = os.environ if environ is None else environ
    view = {k: str(v) for k, v in (getattr(cfg, "env_vars", None) or {}).items()}
    view.update(env)
    version = torch_version or installed_torch_version()
    plan = plan_allocator(
        view, torch_version=version,
        nccl_ub=bool(getattr(getattr(cfg, "ddp", None), "nccl_ub", False)),
        cuda_graph_impl=getattr(getattr(cfg, "model", None), "cuda_graph_impl", None),
        ipc=ipc_flag(view) if ipc is None else ipc)
    live = environ is None or environ is os.environ
    if live and "torch" in sys.modules and _cuda_initialized():
        plan.findings.append(Finding(
            "cuda_initialized", "error", "cfg.env_vars",
            "CUDA is already initialised: allocator variables that Bridge applies now have no effect.", _EARLIER))
    if plan.errors:
        raise AllocatorSetupError(plan.errors)
    for name, (_, new) in plan.changes.items():
        if name in env and env[name] != new:
            plan.findings.append(Finding(
                "shell_wins", "warning", name,
                f"is {env[name]!r} in the shell; Bridge applies cfg.env_vars with os.environ.setdefault, so the "
                f"shell value wins and {new!r} from cfg.env_vars is not applied.",
                f"export {name}={new!r} in the launch script, or call megatron_bridge_ext.init() first"))
    return AllocatorResult(version, plan.reader, "bridge_env_vars" if plan.changes else "unchanged", plan.changes,
                           plan.expandable_segments, plan.findings)


def configure_bridge_env(cfg, *, ipc: Optional[bool] = None, environ: Optional[MutableMapping[str, str]] = None,
                         torch_version: Optional[str] = None) -> AllocatorResult:
    """Fill a Bridge ``ConfigContainer``'s ``env_vars`` with the allocator settings (see :func:`plan_bridge_env`)."""
    result = plan_bridge_env(cfg, ipc=ipc, environ=environ, torch_version=torch_version)
    if getattr(cfg, "env_vars", None) is None:
        cfg.env_vars = {}
    for name, (_, new) in result.changes.items():
        cfg.env_vars[name] = new
    _log(result)
    return result


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------


@dataclass
class AllocatorVerification:
    on_device: bool  # checked on a CUDA device (else: configuration only)
    configured: Optional[bool]  # expandable_segments as the environment / torch settings say
    in_effect: Optional[bool]  # the segment holding a fresh allocation is expandable (device only)
    source: str  # where the answer comes from
    message: str
    segments: int = 0
    expandable_segments: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify_allocator(device=None, environ: Optional[MutableMapping[str, str]] = None) -> AllocatorVerification:
    """Prove expandable segments are in effect after an allocation (GPU), or report the configuration (CPU).

    On a device: allocate 4 MiB, take ``torch.cuda.memory._snapshot()``, find the segment that
    holds the allocation and read its ``is_expandable`` (torch 2.14.1 puts it on every segment;
    ``allocator_settings["expandable_segments"]`` in the same snapshot is the configured flag).
    """
    env = os.environ if environ is None else environ
    import torch

    version = torch.__version__
    name, conf = effective(env, parse_version(version))
    configured = bool(conf.flag("expandable_segments"))
    where = f"{name}={env[name]!r}" if name else f"neither {CUDA_VAR} nor {ALLOC_VAR} set"
    if not torch.cuda.is_available():
        return AllocatorVerification(
            False, configured, None, "environment",
            f"not verified on a device (no CUDA device): configured expandable_segments={configured} from {where}")
    backend = torch.cuda.memory.get_allocator_backend()
    if backend != "native":
        return AllocatorVerification(
            True, False, False, "torch.cuda.memory.get_allocator_backend",
            f"allocator backend is {backend!r}: it has no expandable segments")
    probe = torch.empty(4 << 20, dtype=torch.uint8, device=device if device is not None else "cuda")
    try:
        snapshot = torch.cuda.memory._snapshot(probe.device)
        settings = snapshot.get("allocator_settings", {})
        configured = bool(settings.get("expandable_segments", configured))
        ptr = probe.data_ptr()
        segments = [s for s in snapshot["segments"] if s.get("device", probe.device.index) == probe.device.index]
        holder = next((s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"]), None)
    finally:
        del probe
    if holder is None or "is_expandable" not in holder:
        return AllocatorVerification(
            True, configured, None, "torch.cuda.memory._snapshot()['allocator_settings']",
            "could not find the segment holding the probe allocation (or its is_expandable field) in the snapshot; "
            f"allocator_settings says expandable_segments={configured}", len(segments))
    in_effect = bool(holder["is_expandable"])
    count = sum(bool(s.get("is_expandable")) for s in segments)
    return AllocatorVerification(
        True, configured, in_effect, "torch.cuda.memory._snapshot() segment is_expandable",
        f"expandable segments {'in effect' if in_effect else 'NOT in effect'}: the segment holding a fresh 4 MiB "
        f"allocation has is_expandable={in_effect} ({count} of {len(segments)} segments expandable)",
        len(segments), count)


# --------------------------------------------------------------------------------------------
# Reporting (mbx env)
# --------------------------------------------------------------------------------------------

_DISTRIBUTIONS = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core",),
    "megatron-bridge": ("megatron-bridge",),
    "transformer-engine": ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12",
                           "transformer-engine-cu13"),
}


def package_versions() -> dict[str, Optional[str]]:
    """Installed versions from package metadata (nothing is imported); None when not installed."""
    versions: dict[str, Optional[str]] = {}
    for label, names in _DISTRIBUTIONS.items():
        versions[label] = None
        for name in names:
            try:
                versions[label] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def describe_environment(environ: Optional[MutableMapping[str, str]] = None, *, nccl_ub: bool = False,
                         cuda_graph_impl: Optional[str] = None, ipc: Optional[bool] = None) -> dict[str, Any]:
    """The effective allocator settings now, what setup would change, and the guard findings."""
    env = os.environ if environ is None else environ
    versions = package_versions()
    report: dict[str, Any] = {"versions": versions, "variables": {n: env.get(n) for n in VARIABLES}}
    if versions["torch"] is None:
        report["error"] = "torch is not installed"
        return report
    report["reader"] = precedence_for(parse_version(versions["torch"])).note
    try:
        name, conf = effective(env, parse_version(versions["torch"]))
        plan = plan_allocator(env, torch_version=versions["torch"], nccl_ub=nccl_ub, cuda_graph_impl=cuda_graph_impl,
                              ipc=ipc_flag(env) if ipc is None else ipc)
    except (AllocatorConfigError, ValueError) as error:
        report["error"] = str(error)
        return report
    report["effective"] = {"variable": name, "value": conf.render(),
                           "expandable_segments": bool(conf.flag("expandable_segments"))}
    report["setup_would_change"] = {k: {"old": o, "new": n} for k, (o, n) in plan.changes.items()}
    report["expandable_segments_after_setup"] = plan.expandable_segments
    report["findings"] = [f.to_dict() for f in plan.findings]
    return report
