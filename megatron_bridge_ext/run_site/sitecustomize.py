"""``mbx run``'s start-up hook (see :mod:`megatron_bridge_ext.run_site`).

Run by Python as ``sitecustomize`` before the script: with ``MBX_RUN_INIT=1`` it installs the import
hooks ``megatron_bridge_ext.init()`` installs (:func:`~megatron_bridge_ext.patches.registry.install_init_hooks`;
nothing upstream and not torch is imported here), then runs the next ``sitecustomize`` further on
``sys.path`` under the same name, so a user's or a distribution's one still runs. The allocator
variables need no hook: ``mbx run`` already put them in the environment.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _install() -> None:
    if os.environ.get("MBX_RUN_INIT") == "1":
        from megatron_bridge_ext.patches.registry import install_init_hooks

        install_init_hooks()


def _next_sitecustomize() -> None:
    """Run the ``sitecustomize`` Python would have found without this folder first on the path."""
    here = os.path.dirname(os.path.realpath(__file__))
    positions = [i for i, entry in enumerate(sys.path) if os.path.realpath(entry or os.curdir) == here]
    if not positions:
        return
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path[positions[-1] + 1:])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    try:
        _install()
    finally:
        _next_sitecustomize()
