"""The wheel ships the package (patches, the demo and its harness, megatron_bridge_ext.testing, included) and nothing
of the tests."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _sources(into: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked, plus new files git does not ignore), copied to
    ``into``: the wheel is built from them, not from the working tree, whose build/ and egg-info folders are shared
    with every other build and whose package folder may hold files a clone lacks (caches, scratch modules)."""
    import shutil

    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    return into


def _wheel(tmp_path: Path) -> tuple[Path, Path]:
    """The wheel built (no dependencies, no isolation) from a copy of the sources, and that copy."""
    source = _sources(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, text=True)
    (wheel,) = (tmp_path / "dist").glob("megatron_bridge_ext-*.whl")
    return wheel, source


def test_wheel_ships_every_package_module_and_no_tests(tmp_path):
    wheel, source = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    expected = {str(p.relative_to(source)) for p in (source / "megatron_bridge_ext").rglob("*.py")}
    assert {"megatron_bridge_ext/patches/registry.py", "megatron_bridge_ext/testing/cpu_emulation.py",
            "megatron_bridge_ext/testing/bridge/recipe.py", "megatron_bridge_ext/demo/train.py"} <= expected
    assert expected <= set(names), sorted(expected - set(names))
    assert "megatron_bridge_ext/device_check/estimates.json" in names  # package data the device check reads
    assert not [n for n in names if n.split("/")[0] == "patches"]
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Requires-Python: <3.13,>=3.12" in text
    assert "Provides-Extra: te" in text and "Provides-Extra: test" in text
    entry_points = zipfile.ZipFile(wheel).read(metadata.replace("METADATA", "entry_points.txt")).decode()
    assert "mbx = megatron_bridge_ext.cli:main" in entry_points
    assert not [n for n in names if n.startswith("tests/")]  # test support never ships


def test_commands_run_from_the_installed_wheel_alone(tmp_path):
    """mbx patches, mbx env and mbx diagnose from the wheel's files, outside the source checkout."""
    import json
    import os
    import shutil

    wheel, _ = _wheel(tmp_path)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "memory_stats_fragmentation.json", work / "stats.json")
    env = dict(os.environ, PYTHONPATH=str(site), MBX_LOG_LEVEL="WARNING")

    def mbx(*args):
        done = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    where = subprocess.run([sys.executable, "-c", "import megatron_bridge_ext; print(megatron_bridge_ext.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout
    from megatron_bridge_ext.patches import PATCHES

    assert [row["name"] for row in json.loads(mbx("patches", "--json"))] == [p.name for p in PATCHES]
    assert "torch" in json.loads(mbx("env", "--json"))["versions"]
    assert mbx("diagnose", "stats.json").startswith("fragmentation:")
