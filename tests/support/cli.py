"""What the command tests share: `mbx` in a child process, and the one clean line bad input must give."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOC, CUDA = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"


def mbx(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    return subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", *args], cwd=cwd, text=True,
                          capture_output=True, env={**base, **(env or {})}, timeout=600)


def _one_clean_line(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """The last stderr line carries the message; nothing looks like a traceback; the exit status is not 0."""
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in line, (fragment, done.stderr)
    return line
