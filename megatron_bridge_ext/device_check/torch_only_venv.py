"""Make a virtualenv that has torch and torch's own dependencies, and nothing else.

    .venv/bin/python -m megatron_bridge_ext.device_check.torch_only_venv DIR

Stands in, on a CPU machine, for the GPU machine the device check runs on (Python 3.12 and torch, no
Megatron, with pip): the device rehearsal installs the carried wheels into it and runs the device check's dry
mode, so that a wheel missing from requirements/device.txt fails here. Instead of downloading torch
again, it links torch's distribution (and its dependencies', found from their metadata) from the
interpreter that runs this script.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
import sysconfig
from pathlib import Path


def closure(name: str, seen: dict) -> dict:
    """torch's distribution and every distribution it requires (no extras), by normalised name."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return seen
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return seen
    seen[key] = dist
    for requirement in dist.requires or []:
        if "extra ==" not in requirement:
            closure(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0], seen)
    return seen


def make(target: Path) -> int:
    """The virtualenv at ``target``, torch linked in; 2 when ``target`` exists (it is never overwritten)."""
    target = target.resolve()
    if target.exists():
        print(f"torch_only_venv: {target} exists; remove it first", file=sys.stderr)
        return 2
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)  # with pip, as the GPU machine has
    source = Path(sysconfig.get_paths()["purelib"])
    site = next(target.glob("lib/python3*/site-packages"))
    entries = set()
    for dist in closure("torch", {}).values():
        entries |= {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
    for entry in sorted(entries):
        if (source / entry).exists() and not (site / entry).exists():
            (site / entry).symlink_to(source / entry)
    print(f"torch_only_venv: {target} with {len(entries)} entries linked from {source}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("torch_only_venv: give the virtualenv's folder. Fix: python -m "
              "megatron_bridge_ext.device_check.torch_only_venv DIR", file=sys.stderr)
        return 2
    return make(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
