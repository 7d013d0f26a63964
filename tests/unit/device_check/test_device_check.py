"""The device check as a package: it imports neither torch nor Megatron, and runs its parts as modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_device_check_package_imports_neither_torch_nor_megatron():
    """The GPU machine has no Megatron until the carried wheels are installed by the package's own __main__."""
    code = ("import pkgutil, importlib, sys, megatron_bridge_ext.device_check as kit\n"
            "names = [m.name for m in pkgutil.iter_modules(kit.__path__)]\n"
            "for name in names: importlib.import_module(f'megatron_bridge_ext.device_check.{name}')\n"
            "print(sorted(names)); print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    names, heavy = done.stdout.splitlines()
    assert "'__main__'" in names and "'check'" in names and "'peak_memory'" in names
    assert heavy == "[]"


def test_the_device_kit_runs_its_parts_as_modules_without_editing_sys_path():
    files = [*(ROOT / "scripts").iterdir(), *(ROOT / "megatron_bridge_ext" / "device_check").glob("*.py")]
    assert [f.name for f in files if "sys.path" in f.read_text()] == []
    for shell in ("device_check.sh", "device_wheels.sh", "device_rehearsal.sh"):
        assert "-m megatron_bridge_ext.device_check" in (ROOT / "scripts" / shell).read_text(), shell
