"""`python -m megatron_bridge_ext.device_check` and scripts/device_check.sh: bad options and uninstallable wheels stop it first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _device_command(tmp_path, *argv) -> subprocess.CompletedProcess:
    """``python -m megatron_bridge_ext.device_check`` with one carried 'wheel' that is not a wheel."""
    (tmp_path / "whl").mkdir()
    (tmp_path / "whl" / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    env = dict(os.environ, PYTHONPATH=str(ROOT), MBX_WHEELS=str(tmp_path / "whl"),
               MBX_DEVICE_SITE=str(tmp_path / "site"), OUT=str(tmp_path / "out"))
    return subprocess.run([sys.executable, "-m", "megatron_bridge_ext.device_check", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)


def test_the_device_command_refuses_a_bad_option_before_installing_anything(tmp_path):
    done = _device_command(tmp_path, "--layers", "0")
    assert done.returncode == 2
    assert "--layers=0" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "site").exists() and not (tmp_path / "out").exists()


def test_a_carried_wheel_that_does_not_install_stops_the_check_with_the_fix(tmp_path):
    done = _device_command(tmp_path, "--dry-run")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith("device_check: installing the carried wheels from ")
    assert "Fix: rebuild them with scripts/device_wheels.sh" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_one_command_runs_the_module_from_the_repository_root_wherever_it_is_started(tmp_path):
    """scripts/device_check.sh from another folder, no PYTHONPATH: it reaches the module's option check."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, MBX_WHEELS=str(tmp_path / "none"), OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--layers", "0"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 2
    assert "usage: python -m megatron_bridge_ext.device_check" in done.stderr and "--layers=0" in done.stderr
