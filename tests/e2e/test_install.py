"""The README's install lines, taken from README.md and run as written, in fresh venvs that already hold Bridge.

Each venv is made by ``python -m venv`` from this interpreter's base Python; a ``.pth`` file puts this
environment's site-packages after its own, so torch, Megatron Core and Megatron Bridge (installed with
``--no-deps`` by ``scripts/setup_env.sh``) are installed there as far as pip and imports can tell,
without copying them, and pip leaves them alone (they lie outside the venv). The README's
``/path/to/megatron-bridge-ext`` is a copy of the checkout's tracked files. Nothing is downloaded:
``PIP_NO_INDEX=1``, and ``PIP_NO_BUILD_ISOLATION=0`` (pip's spelling for "build isolation off") builds
with this environment's setuptools, as the README says to do offline.

* ``bridge-no-deps``: Bridge as this environment holds it, its declared dependencies partly missing.
* ``bridge-with-deps``: the same, with Bridge's, Core's and torch's metadata shadowed by copies that
  declare no dependencies: what pip sees where Bridge was installed with every dependency satisfied.

After each install: ``import megatron_bridge_ext.peft`` from the venv's copy, and the venv's ``mbx --version``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = "/path/to/megatron-bridge-ext"
UPSTREAM = ("megatron-bridge", "megatron-core", "torch")


def readme_install_lines(environment: str) -> list[str]:
    """The command lines of the README block marked ``<!-- readme-install: ENVIRONMENT -->``."""
    pattern = re.compile(rf"<!-- readme-install: {re.escape(environment)} -->\n```bash\n(.*?)```", re.S)
    found = pattern.findall((ROOT / "README.md").read_text())
    assert len(found) == 1, f"README.md must have one install block for {environment}, found {len(found)}"
    lines = [line.split("#")[0].strip() for line in found[0].splitlines()]
    return [line for line in lines if line]


def _checkout_copy(dest: Path) -> Path:
    """The tracked files of the checkout (what a user's clone holds), so the build leaves the tree alone."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return dest


def _venv_with_bridge(path: Path) -> Path:
    """A fresh venv whose pip and imports see this environment's packages (Bridge among them) as installed."""
    subprocess.run([sys._base_executable, "-m", "venv", str(path)], check=True, capture_output=True, text=True)
    python = path / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _shadow_without_dependencies(python: Path, names) -> None:
    """Metadata copies of ``names`` in the venv that declare no dependencies (first on sys.path, so pip reads them)."""
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for name in names:
        dist = metadata.distribution(name)
        info = site / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.metadata['Name']}\n"
                                       f"Version: {dist.version}\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")


def _run(command, env, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("environment", ["bridge-no-deps", "bridge-with-deps"])
def test_readme_install_lines_install_the_package_next_to_bridge(environment, tmp_path):
    source = _checkout_copy(tmp_path / "megatron-bridge-ext")
    python = _venv_with_bridge(tmp_path / "venv")
    if environment == "bridge-with-deps":
        _shadow_without_dependencies(python, UPSTREAM)
    bin_dir = python.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]), VIRTUAL_ENV=str(python.parents[1]),
               PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1",
               MBX_LOG_LEVEL="WARNING")
    work = tmp_path / "work"
    work.mkdir()

    for name in UPSTREAM:  # pip sees Bridge, Core and torch as installed before anything is run
        assert _run([str(python), "-m", "pip", "show", name], env, work).returncode == 0, name

    lines = readme_install_lines(environment)
    assert lines and all(line.startswith("pip install") for line in lines), lines
    for line in lines:
        done = _run(["bash", "-c", line.replace(PLACEHOLDER, str(source))], env, work)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        installed = re.findall(r"Successfully installed (.*)", done.stdout)
        assert [name.rsplit("-", 1)[0] for name in installed[-1].split()] == ["megatron-bridge-ext"], done.stdout

    where = _run([str(python), "-c", "import megatron_bridge_ext.peft, megatron_bridge_ext as m; print(m.__file__)"],
                 env, work)
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.strip().startswith(str(tmp_path / "venv")), where.stdout  # the venv's copy, not the checkout
    version = _run([str(bin_dir / "mbx"), "--version"], env, work)
    assert version.returncode == 0, version.stderr[-3000:]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.stdout.split() == ["megatron-bridge-ext", declared]
