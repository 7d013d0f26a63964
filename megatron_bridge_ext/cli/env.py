"""``mbx env``: the effective allocator settings, what the setup would change, and the guard findings."""

from __future__ import annotations

import json
import os
from typing import Any, MutableMapping, Optional

from megatron_bridge_ext.levers.allocator.options import VARIABLES, AllocatorConfigError, effective, parse_version, precedence_for
from megatron_bridge_ext.levers.allocator.env_plan import ipc_flag, plan_allocator
from megatron_bridge_ext.findings import ERROR, Finding
from megatron_bridge_ext.versions import package_versions


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


def _verify_after_setup(args) -> dict:
    """Apply the setup to this process, then check on the device (imports torch)."""
    from megatron_bridge_ext.levers.allocator import setup_allocator, verify_allocator

    setup_allocator(nccl_ub=args.nccl_ub, cuda_graph_impl=args.cuda_graph_impl, ipc=args.ipc)
    return verify_allocator().to_dict()


REFUSED_STATUS = 2
"""Exit status of a report with an error (a malformed variable, a guard that refuses): ``mbx run``'s for the same."""


def command(args) -> int:
    report = describe_environment(nccl_ub=args.nccl_ub, cuda_graph_impl=args.cuda_graph_impl, ipc=args.ipc)
    if args.verify and "error" not in report:
        report["verify"] = _verify_after_setup(args)
    errors = "error" in report or any(f["level"] == ERROR for f in report.get("findings", []))
    if args.json:
        print(json.dumps(report, indent=2))
        return REFUSED_STATUS if errors else 0
    print("  ".join(f"{k} {v or 'not installed'}" for k, v in report["versions"].items()))
    for name, value in report["variables"].items():
        print(f"{name:24} {'(unset)' if value is None else repr(value)}")
    if "error" in report:
        print(f"error: {report['error']}")
        return REFUSED_STATUS
    eff = report["effective"]
    print(f"torch reads: {report['reader']}")
    print(f"effective now: {eff['variable'] or 'none set'} -> {eff['value']!r} "
          f"(expandable_segments {'on' if eff['expandable_segments'] else 'off'})")
    changes = report["setup_would_change"]
    print("megatron_bridge_ext.init() / mbx run would set: "
          + ("; ".join(f"{k}={c['new']!r}" for k, c in changes.items()) if changes else "nothing"))
    print("findings:" if report["findings"] else "findings: none")
    for f in report["findings"]:
        print(f"  [{f['level']}] {Finding(**f).text()}")
    if "verify" in report:
        print(f"verify: {report['verify']['message']}")
    return REFUSED_STATUS if errors else 0
