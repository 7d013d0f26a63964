"""Shared pytest setup: the repository root is importable (for ``tests.support``), and every suite runs
under :mod:`tests.support.run_guard` (a hang guard per test; under torchrun, a failed rank stops the run)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.support.run_guard import pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol  # noqa: E402,F401
