"""A pytest plugin that keeps a stuck or failed test from holding up the whole run.

Registered by ``tests/conftest.py`` (so every suite has it) and by any throwaway test directory whose
``conftest.py`` imports these hooks.

- Hang guard, every suite: each test (its fixtures' setup and teardown included) runs under
  ``faulthandler.dump_traceback_later(..., exit=True)``. A test still running after
  ``MBX_TEST_HANG_S`` seconds (default :data:`DEFAULT_HANG_S`; ``0`` turns the guard off) has the
  stack of every thread written to the terminal and its process ends with exit status 1. It is not
  a speed check: the default leaves the slowest test (the module fixture of
  ``tests/functional/test_bridge_loop.py``, twelve Bridge runs) several times its time on a loaded
  2-core machine.
- Fail fast, under torchrun (``WORLD_SIZE`` >= 2): the first failed test on a rank writes that rank's
  traceback to the terminal (stderr, which torchrun passes through for every rank; rank 0's pytest
  terminal is stdout, the others' are ``build/functional-rank<N>.log``) and ends the rank's process
  with exit status 1, after killing the processes it started through multiprocessing (a worker pool
  would otherwise live on, orphaned). torchrun then stops the other ranks. Without it the failed rank
  goes on to the next test's collectives while the other rank waits in the failed test's, and both wait
  until their collective timeouts, test after test.
"""

from __future__ import annotations

import faulthandler
import math
import multiprocessing
import os
import sys

import pytest

DEFAULT_HANG_S = 900
HANG_VARIABLE = "MBX_TEST_HANG_S"

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))

_terminal: list = []  # the real stderr, duplicated before pytest captures it
_limit: list = []  # the hang guard's seconds, read once: tests change os.environ


def hang_seconds() -> float:
    """The hang guard's limit from ``MBX_TEST_HANG_S``; a bad value is refused with the fix."""
    text = os.environ.get(HANG_VARIABLE, str(DEFAULT_HANG_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise pytest.UsageError(f"{HANG_VARIABLE}={text!r} is not a number of seconds. "
                                f"Fix: set it to a finite number >= 0 (0 turns the hang guard off), e.g. {DEFAULT_HANG_S}")
    return seconds


def pytest_configure(config):
    """Read the hang limit; keep a file on the terminal's stderr (pytest's capture redirects fd 2 during a test)."""
    _limit[:] = [hang_seconds()]
    if not _terminal:
        _terminal.append(os.fdopen(os.dup(sys.__stderr__.fileno()), "w", buffering=1))


def _say(text: str) -> None:
    _terminal[0].write(text)
    _terminal[0].flush()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arm the hang guard for this test; disarm it when the test is done."""
    seconds = _limit[0]
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=_terminal[0])
    try:
        return (yield)
    finally:
        if seconds > 0:
            faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report):
    """Under torchrun: show a failure's traceback with its rank, then end this rank (torchrun stops the rest)."""
    if WORLD_SIZE < 2 or not report.failed:
        return
    _say(f"\n===== rank {RANK} of {WORLD_SIZE}: {report.nodeid} failed ({report.when}); stopping this rank, "
         f"torchrun stops the others =====\n{report.longreprtext}\n===== end of rank {RANK}'s failure =====\n")
    sys.stdout.flush()
    for child in multiprocessing.active_children():  # os._exit runs no clean-up: they would outlive the rank
        child.kill()
    os._exit(1)
