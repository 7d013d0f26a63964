"""The test-run guard (``tests/support/run_guard.py``) on throwaway pytest sessions: a rank that fails stops
the torchrun job with its traceback shown, and a test stuck past ``MBX_TEST_HANG_S`` has its stack
dumped and its process ended.

The subprocess timeouts are hang detectors (without the guard these sessions wait for an hour-long
process-group timeout), not speed claims.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HANG_DETECTOR_S = 600

CONFTEST = "from tests.support.run_guard import pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol\n"
# An hour-long gloo timeout: a rank left waiting stays in its collective for the whole hang detector.
SESSION = """
import datetime

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
"""


def run_session(directory: Path, tests: str, ranks: int, **env: str) -> subprocess.CompletedProcess:
    """Run pytest with the guard on ``tests`` written to ``directory``; with ``ranks`` > 1 under torchrun,
    the tests after :data:`SESSION`."""
    (directory / "conftest.py").write_text(CONFTEST)
    (directory / "test_session.py").write_text((SESSION if ranks > 1 else "") + textwrap.dedent(tests))
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(directory)]
    environ = {k: v for k, v in os.environ.items() if k not in ("MBX_TEST_HANG_S", "RANK", "WORLD_SIZE")}
    with subprocess.Popen(command, cwd=directory, env=dict(environ, PYTHONPATH=str(ROOT), **env), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        try:
            stdout, stderr = process.communicate(timeout=HANG_DETECTOR_S)
        except subprocess.TimeoutExpired:  # SIGTERM: torchrun then ends its ranks (a SIGKILL would leave them)
            process.terminate()
            process.communicate(timeout=120)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.parametrize("ranks", [2, 4], ids=["functional", "functional-tp4"])
def test_a_rank_that_fails_stops_every_rank_and_its_traceback_is_shown(tmp_path, ranks):
    tests = """
    def test_rank_0_fails_before_a_collective_that_the_others_enter():
        if dist.get_rank() == 0:
            raise AssertionError("rank 0 failed on purpose")
        dist.recv(torch.zeros(1), src=0)  # as the other ranks wait inside Bridge's loop

    def test_the_next_collective():  # rank 0 would wait here for rank 1, which waits in the test before
        dist.recv(torch.zeros(1), src=1 if dist.get_rank() == 0 else 0)
    """
    done = run_session(tmp_path, tests, ranks=ranks)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert f"rank 0 of {ranks}: test_session.py::test_rank_0_fails_before_a_collective_that_the_others_enter failed" \
        in output, output[-3000:]
    assert "AssertionError: rank 0 failed on purpose" in output, output[-3000:]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_failed_rank_leaves_no_process_it_started_behind(tmp_path):
    tests = f"""
    import multiprocessing
    import time

    def test_rank_0_starts_a_worker_then_fails():
        if dist.get_rank() == 0:
            worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(3600,))
            worker.start()
            open({str(tmp_path / "worker.pid")!r}, "w").write(str(worker.pid))
            raise AssertionError("rank 0 failed on purpose")
        dist.recv(torch.zeros(1), src=0)
    """
    done = run_session(tmp_path, tests, ranks=2)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "rank 0 failed on purpose" in output, output[-3000:]
    pid = int((tmp_path / "worker.pid").read_text())
    for _ in range(60):  # the kill is sent before the rank exits; init reaps the worker soon after
        if not _alive(pid):
            break
        time.sleep(0.5)
    assert not _alive(pid), f"rank 0's worker {pid} outlived the run"


def test_a_stuck_rank_has_its_stack_dumped_and_stops_the_run(tmp_path):
    tests = """
    def test_each_rank_waits_for_the_other():
        dist.recv(torch.zeros(1), src=1 - dist.get_rank())
    """
    done = run_session(tmp_path, tests, ranks=2, MBX_TEST_HANG_S="5")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "Timeout (0:00:05)!" in output, output[-3000:]
    assert "in test_each_rank_waits_for_the_other" in output, output[-3000:]


def test_a_bad_hang_limit_is_refused_with_the_fix(tmp_path):
    done = run_session(tmp_path, "def test_nothing():\n    pass\n", ranks=1, MBX_TEST_HANG_S="ten")
    assert done.returncode != 0
    assert "MBX_TEST_HANG_S='ten' is not a number of seconds. Fix: " in done.stderr, done.stderr[-3000:]
