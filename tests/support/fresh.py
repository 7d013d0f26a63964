"""Run a scenario in a fresh interpreter and get back what it reported.

Imports are process-global (a module imported once stays imported, a patched class stays patched),
so scenarios about imports and patches run in their own interpreter: ``run(*parts)`` executes the
code ``parts`` with ``sys.executable -c`` from the repository root and returns the keyword
arguments of the last ``report(...)`` the code called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, sys

def report(**values):
    print("RESULT " + json.dumps(values))
"""


def run(*parts: str, timeout: int = 600) -> dict:
    """Run the code ``parts`` in a fresh interpreter; return the keyword arguments of its last ``report()``."""
    script = "\n".join(textwrap.dedent(part) for part in (PRELUDE, *parts))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(results[-1].removeprefix("RESULT "))
