"""The wheel ships the package (patches and demo harness included) and nothing of the tests."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_every_package_module_and_no_tests(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("megatron_bridge_ext-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "megatron_bridge_ext").rglob("*.py")}
    assert {"megatron_bridge_ext/patches/registry.py", "megatron_bridge_ext/demo/cpu_emulation.py"} <= expected
    assert expected <= set(names), sorted(expected - set(names))
    assert not [n for n in names if n.split("/")[0] == "patches"]
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Requires-Python: <3.13,>=3.12" in text
    assert "Provides-Extra: te" in text and "Provides-Extra: test" in text
    entry_points = zipfile.ZipFile(wheel).read(metadata.replace("METADATA", "entry_points.txt")).decode()
    assert "mbx = megatron_bridge_ext.cli:main" in entry_points
    assert not [n for n in names if n.startswith("tests/")]  # test support never ships
