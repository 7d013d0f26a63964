"""Run a module on CPU ranks with the test-support CUDA emulation installed first.

``python -m tests.support.cpu_run MODULE [ARGS...]``: used by ``mbx demo`` and ``mbx bench`` on
machines without CUDA (CI, laptops), so that the product itself never imports the emulation.
"""

import runpy
import sys

from megatron_bridge_ext import logs
from tests.support import cpu_emulation


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tests.support.cpu_run MODULE [ARGS...]")
    module = sys.argv[1]
    sys.argv = [module] + sys.argv[2:]
    logs.configure()
    cpu_emulation.install()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
