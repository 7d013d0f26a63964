"""`mbx env`: versions, settings and findings, as text or JSON; its bad input in one line."""

from __future__ import annotations

import json
import os

import pytest

from megatron_bridge_ext.cli import main
from tests.support.cli import ALLOC, CUDA, ROOT, _one_clean_line, mbx

pytestmark = pytest.mark.unit


def requirements_pins() -> dict[str, set[str]]:
    """Every version the repository's requirements pin per distribution (an independent source)."""
    pins: dict[str, set[str]] = {}
    for path in (ROOT / "requirements").glob("*.txt"):
        for line in path.read_text().splitlines():
            name, sep, version = line.split("#")[0].strip().partition("==")
            if sep:
                pins.setdefault(name, set()).add(version)
    return pins


@pytest.fixture
def clean_env(monkeypatch):
    for name in (ALLOC, CUDA, "MBX_ALLOCATOR_IPC", "NCCL_GRAPH_REGISTER"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_env_json_reports_versions_settings_and_findings(clean_env, capsys):
    clean_env.setenv(CUDA, "max_split_size_mb:512")
    assert main(["env", "--json", "--cuda-graph-impl", "local"]) == 0
    report = json.loads(capsys.readouterr().out)
    import torch
    from megatron.core import package_info
    from packaging.version import Version

    # the report reads package metadata; the imported modules say their own versions
    assert report["versions"]["torch"] == Version(torch.__version__).base_version
    assert report["versions"]["megatron-core"] == Version(package_info.__version__).base_version
    assert report["versions"]["transformer-engine"] is None  # not installed here
    assert report["versions"]["megatron-bridge"] in requirements_pins()["megatron-bridge"]
    assert report["effective"] == {"variable": CUDA, "value": "max_split_size_mb:512", "expandable_segments": False}
    assert report["setup_would_change"] == {
        CUDA: {"old": "max_split_size_mb:512", "new": "max_split_size_mb:512,expandable_segments:True"},
        "NCCL_GRAPH_REGISTER": {"old": None, "new": "0"}}
    assert {f["code"] for f in report["findings"]} == {"max_split_size", "cuda_graphs"}
    assert os.environ[CUDA] == "max_split_size_mb:512"  # mbx env changes nothing


def test_env_text_and_error_exit(clean_env, capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch reads: PYTORCH_CUDA_ALLOC_CONF if set" in out and "PYTORCH_ALLOC_CONF='expandable_segments:True'" in out
    clean_env.setenv("NCCL_GRAPH_REGISTER", "1")
    assert main(["env", "--cuda-graph-impl", "local"]) == 2
    assert "[error] NCCL_GRAPH_REGISTER" in capsys.readouterr().out
    clean_env.setenv(ALLOC, "expandable_segments:yes")
    assert main(["env"]) == 2  # as mbx run exits for the same variable
    assert "expandable_segments:yes" in capsys.readouterr().out


def test_env_verify_on_cpu_applies_the_setup_and_says_it_could_not_verify_on_a_device(clean_env, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU path")
    assert main(["env", "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verify"]["on_device"] is False and report["verify"]["configured"] is True
    assert "not verified on a device" in report["verify"]["message"]
    assert os.environ[ALLOC] == "expandable_segments:True"  # --verify applies the setup to this process


def test_env_refuses_an_unknown_cuda_graph_impl():
    _one_clean_line(mbx("env", "--cuda-graph-impl", "bogus"), "--cuda-graph-impl", "invalid choice")
