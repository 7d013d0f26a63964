"""Run a module or script on CPU ranks with the CPU emulation installed first.

``python -m megatron_bridge_ext.testing.cpu_run [--bridge] MODULE|SCRIPT.py [ARGS...]``: how
:mod:`megatron_bridge_ext.demo.launch` starts the demo and benchmark ranks on a machine without CUDA. ``--bridge`` also readies Megatron
Bridge's training loop (:func:`.cpu_emulation.bridge_imports`, then the whole run inside
:func:`.cpu_emulation.bridge_loop`), for ``mbx demo --bridge`` and Bridge training scripts such as
the example in docs/tools/bridge-loop.md.
"""

import runpy
import sys

from megatron_bridge_ext import logs
from megatron_bridge_ext.testing import cpu_emulation

USAGE = "usage: python -m megatron_bridge_ext.testing.cpu_run [--bridge] MODULE|SCRIPT.py [ARGS...]"


def main() -> None:
    args = sys.argv[1:]
    bridge = args[:1] == ["--bridge"]
    args = args[1:] if bridge else args
    if not args:
        raise SystemExit(USAGE)
    target = args[0]
    sys.argv = [target] + args[1:]
    logs.configure(verbose="--verbose" in args[1:])  # the rank's own options, before torch is imported
    cpu_emulation.install()
    if not bridge:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    cpu_emulation.bridge_imports()
    with cpu_emulation.bridge_loop():
        if target.endswith(".py"):
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
