"""The wheel ships patches/ as megatron_bridge_ext.patches and never as a top-level ``patches`` module."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_maps_patches_into_the_package_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("megatron_bridge_ext-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    expected = {f"megatron_bridge_ext/patches/{p.name}" for p in (ROOT / "patches").glob("*.py")}
    assert expected and expected <= set(names)
    assert not [n for n in names if n.split("/")[0] == "patches"]
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Requires-Python: <3.13,>=3.12" in text
    assert "Provides-Extra: te" in text and "Provides-Extra: test" in text
    entry_points = zipfile.ZipFile(wheel).read(metadata.replace("METADATA", "entry_points.txt")).decode()
    assert "mbx = megatron_bridge_ext.cli:main" in entry_points
    assert not [n for n in names if n.startswith("tests/")]  # test support never ships
