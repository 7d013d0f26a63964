"""The README's ``mbx plan`` examples, each run as written: exit 0, the plan on stdout, and nothing on stderr (the
upstream warnings a successful plan meets are filtered as known and harmless, ``megatron_bridge_ext.logs``), with
the GPU's memory in GiB, as the plan's note on a GB figure asks."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_plan_examples() -> list[str]:
    """Every ``mbx plan`` command of the README's bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if words[:2] == ["mbx", "plan"]:
                commands.append(shlex.join(words))
    return commands


EXAMPLES = readme_plan_examples()


def test_the_readme_shows_its_four_plan_examples():
    """dense LoRA, MoE, FP8 and the hybrid recipe: a dropped example fails here rather than leave the test."""
    assert len(EXAMPLES) == 4, EXAMPLES


@pytest.mark.parametrize("command", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_a_readme_plan_example_prints_its_plan_and_nothing_on_stderr(command):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                                           "MBX_LOG_LEVEL")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # mbx of this venv
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines()[0] == "$ " + command  # the plan's own first line: the command it ran
    assert done.stdout.splitlines()[1].startswith("config: ")
    assert done.stderr == ""
    # The examples write a GPU's memory the way the note of a GB figure tells (sizes.sold_as_note): in GiB.
    assert "a GPU sold as" not in done.stdout
