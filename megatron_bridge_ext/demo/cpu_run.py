"""Run a module on CPU ranks with the CPU emulation installed first.

``python -m megatron_bridge_ext.demo.cpu_run MODULE [ARGS...]``: how :mod:`.launch` starts the
demo and benchmark ranks on a machine without CUDA.
"""

import runpy
import sys

from megatron_bridge_ext import logs
from megatron_bridge_ext.demo import cpu_emulation


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m megatron_bridge_ext.demo.cpu_run MODULE [ARGS...]")
    module = sys.argv[1]
    sys.argv = [module] + sys.argv[2:]
    logs.configure()
    cpu_emulation.install()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
