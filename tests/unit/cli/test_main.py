"""What every ``mbx`` command shares: a reader that closes the pipe, the same exit status for the same bad
environment, help that states each default once, and messages that say what to do."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_bridge_ext.cli import PIPE_CLOSED_STATUS, main
from megatron_bridge_ext.findings import LEVELS
from tests.support.cli import CUDA, ROOT, _one_clean_line, mbx

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [["env"], ["diagnose", "tests/data/memory_stats_capacity.json"]],
                         ids=["env", "diagnose"])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(argv, buffered):
    """As ``mbx ... | head`` does: the read end is closed before the command writes; no traceback, no
    "Exception ignored" from the flush at exit. Buffered: the output is still in Python's buffer when the command
    returns (a pipe is block-buffered unless PYTHONUNBUFFERED is set)."""
    env = {k: v for k, v in os.environ.items() if not (buffered and k == "PYTHONUNBUFFERED")}
    child = subprocess.Popen([sys.executable, "-m", "megatron_bridge_ext.cli", *argv], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    child.stdout.close()
    err = child.stderr.read()
    assert child.wait(timeout=300) == PIPE_CLOSED_STATUS, err
    assert err == ""


def test_env_and_run_exit_alike_for_the_same_malformed_variable():
    env = {CUDA: "max_split_size_mb:abc"}
    statuses = {mbx("env", env=env).returncode, mbx("run", "--", sys.executable, "-c", "pass", env=env).returncode}
    assert statuses == {2}


def test_bench_without_a_benchmark_names_the_one_there_is(capsys):
    assert main(["bench"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == ("mbx bench: no benchmark named. Fix: mbx bench memory (the LoRA-A input "
                                         "variants side by side; mbx bench memory --help)")


@pytest.mark.parametrize("command", [["demo"], ["bench", "memory"]])
def test_demo_help_states_each_default_once_and_none_for_flags(command):
    text = mbx(*command, "--help").stdout
    options = re.split(r"\n  (?=-)", text)
    assert len(options) > 10
    for option in options:
        assert option.count("default") <= 1, option
        assert "(default: False)" not in option and "(default: None)" not in option, option


def test_the_allocator_page_shows_the_levels_mbx_env_prints():
    page = (ROOT / "docs" / "levers" / "allocator.md").read_text()
    shown = set(re.findall(r"^  \[([a-z ]+)\] ", page, flags=re.MULTILINE))
    assert shown and shown <= set(LEVELS), shown


def test_init_refuses_an_unknown_cuda_graph_impl_before_changing_anything(monkeypatch):
    import os

    from megatron_bridge_ext import init

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv(CUDA, raising=False)
    with pytest.raises(ValueError, match=r"cuda_graph_impl='bogus' is not one of Megatron Core's none, local, "
                                         r"transformer_engine, full_iteration\. Fix: "):
        init(cuda_graph_impl="bogus")
    assert "PYTORCH_ALLOC_CONF" not in os.environ and CUDA not in os.environ


def test_run_refuses_an_unknown_cuda_graph_impl_by_its_choices():
    _one_clean_line(mbx("run", "--cuda-graph-impl", "bogus", "--", "true"), "--cuda-graph-impl", "invalid choice")
