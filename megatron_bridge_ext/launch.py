"""Start N ranks of one of our worker modules with torchrun (or run in place under torchrun).

On GPUs the workers run as they are. Without CUDA, Megatron Core's tensor/sequence-parallel
layers need a few CUDA-only calls redirected to the CPU; that emulation is test-support code of
the repository (``tests/support``), so CPU runs start from a source checkout and go through
``tests.support.cpu_run``. The package itself never imports it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU_RUNNER = REPO_ROOT / "tests" / "support" / "cpu_run.py"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def torchrun_command(module: str, args: list[str], nproc: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start ``module`` on ``nproc`` local ranks."""
    env = dict(os.environ)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if _cuda_available():
        return launcher + ["-m", module, *args], env
    if not CPU_RUNNER.is_file():
        raise RuntimeError(
            "No CUDA device: CPU runs need the repository's tests/support/cpu_run.py (CPU emulation of "
            f"CUDA-only Megatron Core calls), not found under {REPO_ROOT}. Run from a source checkout "
            "(pip install -e .) or on GPUs."
        )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return launcher + ["-m", "tests.support.cpu_run", module, *args], env


def launch(module: str, args: list[str], nproc: int) -> int:
    """Start ``module`` on ``nproc`` ranks and return the exit status."""
    command, env = torchrun_command(module, args, nproc)
    return subprocess.call(command, env=env)
