"""The device check in one command: the carried wheels installed, then every part of the check.

    python -m megatron_bridge_ext.device_check [--dry-run] [--layers N] [--budget S] [--out DIR]
    (scripts/device_check.sh runs it from the repository root with $PYTHON, default python3)

On a GPU machine that has Python 3.12 and torch but no Megatron and no network, the wheels in
``.whl/`` (or ``$MBX_WHEELS``; made by ``scripts/device_wheels.sh`` where the package index is
reachable, then carried along) are installed into a private folder first (``$MBX_DEVICE_SITE``,
default ``/tmp/mbx-device-site``); nothing is installed into the system. Without carried wheels the
check uses what this Python already has, and says so. The check (:mod:`.check`) then runs in a fresh
interpreter whose ``PYTHONPATH`` puts the working directory and that folder first, as do the parts it
starts. Results go to ``${OUT:-build/device}/device_check.json``; the exit status is non-zero when a
check failed or did not run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_bridge_ext.device_check import check, wheels

DEFAULT_SITE = "/tmp/mbx-device-site"


def _pythonpath(site: Path | None) -> str:
    """The working directory (this checkout's package), the installed wheels, then the caller's own entries."""
    entries = [os.getcwd(), *([str(site)] if site else []), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(entry for entry in entries if entry)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check.parse_args(argv)  # a bad option stops here, before anything is installed
    carried = Path(os.environ.get("MBX_WHEELS", ".whl"))
    site = Path(os.environ.get("MBX_DEVICE_SITE", DEFAULT_SITE))
    if any(carried.glob("*.whl")):
        try:
            count = wheels.install(carried, site)
        except wheels.WheelError as error:
            print(f"device_check: {error}", file=sys.stderr)
            return 2
        print(f"device_check: installed {count} carried wheels from {carried}/ into {site}", flush=True)
    else:
        print(f"device_check: no carried wheels in {carried}/; using the packages {sys.executable} already has",
              flush=True)
        site = None
    env = dict(os.environ, PYTHONPATH=_pythonpath(site), PYTHONUNBUFFERED="1")
    os.execve(sys.executable, [sys.executable, "-m", "megatron_bridge_ext.device_check.check", *argv], env)


if __name__ == "__main__":
    sys.exit(main())
