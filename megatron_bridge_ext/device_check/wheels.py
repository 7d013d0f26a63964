"""The wheels carried to the GPU machine: downloaded here, installed there into a private folder.

    python -m megatron_bridge_ext.device_check.wheels [DIR]        (default .whl; scripts/device_wheels.sh)

:func:`download`, where the package index is reachable, fetches the wheels of ``requirements/device.txt``
into ``DIR`` (git-ignored ``.whl/`` by default) for Python 3.12 on x86-64 Linux, builds the one
sdist-only package into a wheel and checks the set against its budget; carry ``DIR`` to the GPU
machine. :func:`install` there puts them into a folder of their own with pip (nothing goes into the
system), so the machine's own Python and torch stay as they are.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

PINS = Path("requirements/device.txt")
BUDGET_MIB = 48
"""The carry limit is 64 MiB, the working tree included."""
SDIST_ONLY = "antlr4-python3-runtime"
"""Published as an sdist only: built here into a pure-Python wheel."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
MiB = 1 << 20


class WheelError(Exception):
    """A wheel set that cannot be carried or installed; the message names the fix."""


def pins(path: Path = PINS) -> list[str]:
    """The ``name==version`` lines of the pinned list, comments and blank lines dropped."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def download(dest: Path) -> int:
    """The pinned wheels into ``dest`` (its old wheels removed first); their total bytes, within the budget."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    wanted = pins()
    binary = [pin for pin in wanted if not pin.startswith(f"{SDIST_ONLY}==")]
    sdist = [pin for pin in wanted if pin.startswith(f"{SDIST_ONLY}==")]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *binary],
                   check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), *sdist], check=True)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(wheel.stat().st_size for wheel in wheels)
    print(f"device_wheels: {len(wheels)} wheels, {size // MiB} MiB in {dest} (budget {BUDGET_MIB} MiB)")
    if len(wheels) != len(wanted):
        raise WheelError(f"expected {len(wanted)} wheels (one per line of {PINS}), got {len(wheels)}")
    if size > BUDGET_MIB * MiB:
        raise WheelError(f"the set is over its {BUDGET_MIB} MiB budget; trim {PINS}")
    return size


def install(wheels: Path, site: Path) -> int:
    """The carried wheels into ``site`` (emptied first), for ``PYTHONPATH``; how many there were."""
    carried = sorted(wheels.glob("*.whl"))
    shutil.rmtree(site, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--target", str(site), *map(str, carried)])
    if done.returncode != 0:
        raise WheelError(f"installing the carried wheels from {wheels}/ failed. Fix: rebuild them with "
                         "scripts/device_wheels.sh")
    return len(carried)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_bridge_ext.device_check.wheels",
                                description=__doc__.splitlines()[0])
    p.add_argument("dir", nargs="?", default=".whl", help="where the wheels go (default .whl, git-ignored)")
    args = p.parse_args(argv)
    try:
        download(Path(args.dir))
    except WheelError as error:
        print(f"device_wheels: {error}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as error:
        print(f"device_wheels: pip exited {error.returncode} (its message is above). Fix: reach the package index, "
              f"or correct {PINS}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
