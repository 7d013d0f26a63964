"""Start the ranks of ``mbx demo`` / ``mbx bench memory`` with torchrun, or run in place under torchrun.

One launcher for both: the parent parses and checks the options, then starts ``--tp`` ranks of
the same module. On GPUs the ranks run the module as it is; without CUDA they go through
:mod:`megatron_bridge_ext.testing.cpu_run`, which installs the CPU emulation first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, Optional

CPU_RUN = "megatron_bridge_ext.testing.cpu_run"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def torchrun_command(module: str, args: list[str], nproc: int, *, bridge: bool = False) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start ``module`` on ``nproc`` local ranks.

    ``bridge``: the module runs Megatron Bridge's training loop (on CPU ranks, ``cpu_run --bridge``).
    """
    env = dict(os.environ)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if _cuda_available():
        return launcher + ["-m", module, *args], env
    env.setdefault("OMP_NUM_THREADS", "1")
    return launcher + ["-m", CPU_RUN, *(["--bridge"] if bridge else []), module, *args], env


def run(prog: str, module: str, parser, argv: list[str], worker: Callable, *, check: Optional[Callable] = None,
        bridge: bool = False) -> int:
    """Parse and check ``argv``; under torchrun run ``worker(args)``, else start one rank per TP rank (``args.tp``).

    ``check`` (default: the tiny model's :func:`.options.check`) refuses what the ranks would fail on.
    Bad options exit with status 2 and one line, before any rank starts.
    """
    from megatron_bridge_ext import logs
    from megatron_bridge_ext.demo import options

    args = parser.parse_args(argv)
    if under_torchrun():
        worker(args)
        return 0
    try:
        logs.level_from_env()
        (check or options.check)(args)
    except (options.OptionError, logs.LogLevelError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    print(f"{prog}: starting {args.tp} ranks (torchrun; {'NCCL' if _cuda_available() else 'gloo on the CPU'}); "
          "importing Megatron takes a while on the first run", file=sys.stderr, flush=True)
    command, env = torchrun_command(module, argv, args.tp, bridge=bridge)
    return subprocess.call(command, env=env)
