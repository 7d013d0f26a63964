"""The device check rehearsed on a CPU, so that a missing wheel, import or path fails here, not on the GPU machine.

    .venv/bin/python -m megatron_bridge_ext.device_check.rehearsal     (make device-rehearsal)

From the repository root, with the package index reachable: a virtualenv with torch and nothing else
(:mod:`.torch_only_venv`, standing in for the GPU machine), the carried wheel set downloaded from
``requirements/device.txt`` and checked against its budget (:mod:`.wheels`), then the device command
(``python -m megatron_bridge_ext.device_check --dry-run``) in that virtualenv on tiny shapes. Everything
goes under ``build/rehearsal/``: ``venv``, ``whl``, ``site`` (the installed wheels) and ``out`` (the report).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from megatron_bridge_ext.device_check import torch_only_venv, wheels

WORK = Path("build/rehearsal")


def main() -> int:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    if torch_only_venv.make(WORK / "venv") != 0:
        return 1
    wheel_status = wheels.main([str(WORK / "whl")])
    if wheel_status != 0:
        return wheel_status
    env = dict(os.environ, MBX_WHEELS=str(WORK / "whl"), MBX_DEVICE_SITE=str(WORK.resolve() / "site"),
               OUT=str(WORK / "out"))
    status = subprocess.run([str(WORK / "venv" / "bin" / "python"), "-m", "megatron_bridge_ext.device_check",
                             "--dry-run"], env=env).returncode
    print(f"device_rehearsal: the device check --dry-run exited {status}; report in {WORK}/out/device_check.json")
    return status


if __name__ == "__main__":
    sys.exit(main())
