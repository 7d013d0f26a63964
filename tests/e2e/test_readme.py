"""The runnable blocks of the README and docs/, executed as written, and their shown output compared line by line.

A block preceded by ``<!-- readme-test: run -->`` is run in a fresh interpreter (python blocks) or a
shell (bash blocks) from the repository root, with nothing of the test's own setup; the block after
``<!-- readme-test: output -->`` that follows it is what it must print last: the end of stdout must be
those lines exactly. Bridge's warnings may come before them (Megatron-LM's ``training.py``, which Bridge
imports, logs to stdout), its INFO not: importing our package keeps Bridge's import-time INFO off stdout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- readme-test: (run|output) -->\n```(\w*)\n(.*?)```", re.S)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The pages whose examples are checked here, with how many runnable blocks each holds: a block that
# is dropped (or loses its marker) fails the count instead of silently leaving the test.
EXPECTED_BLOCKS = {"docs/recipe-flags.md": 1, "docs/tools/diagnose.md": 6, "docs/tools/plan.md": 1}


def _blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, code, expected output or None) for every runnable block of one page."""
    found, pending = [], None
    for kind, language, body in BLOCK.findall(text):
        if kind == "run":
            if pending:
                found.append(pending)
            pending = (language, body, None)
        elif pending:
            found.append((pending[0], pending[1], body))
            pending = None
    if pending:
        found.append(pending)
    return found


BLOCKS = {page.relative_to(ROOT).as_posix(): _blocks(page.read_text()) for page in PAGES}
CASES = [(name, i, *block) for name, blocks in BLOCKS.items() for i, block in enumerate(blocks)]


def test_the_docs_have_their_runnable_blocks():
    counts = {name: len(blocks) for name, blocks in BLOCKS.items() if blocks}
    assert counts == EXPECTED_BLOCKS, "<!-- readme-test: run --> blocks per page"


@pytest.mark.parametrize("page, index, language, code, expected", CASES, ids=[f"{c[0]}:block{c[1]}" for c in CASES])
def test_docs_block_runs_as_written(page, index, language, code, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env["MBX_LOG_LEVEL"] = "WARNING"
    command = [sys.executable, "-c", code] if language == "python" else ["bash", "-c", code]
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # mbx of this venv
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("INFO")] == [], done.stdout[-4000:]
    if expected is not None:
        want = expected.rstrip("\n").splitlines()
        assert done.stdout.rstrip("\n").splitlines()[-len(want):] == want
