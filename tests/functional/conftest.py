"""Functional tests run on every rank under ``torchrun --nproc_per_node=2 -m pytest tests/functional``.

Every rank runs the same tests in the same order; collectives inside a test pair up across
ranks. Rank 0 reports on the terminal, other ranks write ``build/functional-rank<N>.log``. The first
failure on any rank shows that rank's traceback on the terminal and stops the run (torchrun ends the
other ranks), and a test that hangs has its stack dumped and its process ended: see
``tests/support/run_guard.py`` (``MBX_TEST_HANG_S``).
Without torchrun (plain ``pytest``) every test here is reported as skipped, with the command that
runs them: they need two processes.
On a machine without CUDA the test-support CPU emulation is installed before Megatron Core
is imported, and the process group uses gloo; with CUDA it uses NCCL.
"""

from __future__ import annotations

import os
import sys

import pytest

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))

if WORLD_SIZE >= 2:
    from megatron_bridge_ext.testing import cpu_emulation

    cpu_emulation.install()

NEEDS_RANKS = ("needs 2 ranks: torchrun --nproc_per_node=2 -m pytest tests/functional (make functional)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/functional/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.functional)
        if WORLD_SIZE < 2:
            item.add_marker(pytest.mark.skip(reason=NEEDS_RANKS))


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if WORLD_SIZE < 2 or RANK == 0:
        return
    from _pytest.config import create_terminal_writer

    reporter = config.pluginmanager.getplugin("terminalreporter")
    os.makedirs("build", exist_ok=True)
    log = open(os.path.join("build", f"functional-rank{RANK}.log"), "w")
    reporter._tw = create_terminal_writer(config, file=log)


def pytest_sessionfinish(session, exitstatus):
    if WORLD_SIZE >= 2 and RANK != 0 and exitstatus not in (0, 5):
        print(f"rank {RANK}: functional tests failed (exit {exitstatus}); see build/functional-rank{RANK}.log",
              file=sys.stderr)


@pytest.fixture
def tp2():
    """torch.distributed and Megatron Core parallel state with TP=2 over the 2 ranks; the tensor-parallel group
    as it is now (a test that builds another layout destroys the groups of the one before)."""
    from megatron.core import parallel_state

    from megatron_bridge_ext.testing import distributed

    distributed.init_from_env(tensor_parallel=2)
    return parallel_state.get_tensor_model_parallel_group()
