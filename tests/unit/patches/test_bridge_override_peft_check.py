"""bridge_override_peft_check: a PEFT override Bridge could not build stops the run with one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# bridge_override_peft_check: a PEFT override Bridge cannot build stops the run
# --------------------------------------------------------------------------------------------

TYPO_OVERRIDES = ["+peft._target_=megatron_bridge_ext.peft.LoRA", "+peft.sequence_parallel_input_strategy=shard_lcoal"]
OVERRIDE_SCRIPT = f"""
import megatron_bridge_ext.peft  # allowlists our _target_
from megatron_bridge_ext.patches import bridge_peft_without_te
from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config
from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

cfg = process_config_with_overrides(vanilla_gpt_pretrain_config(), cli_overrides={TYPO_OVERRIDES!r})
report(peft=type(cfg.peft).__name__)
"""


def _run_script(*parts: str) -> subprocess.CompletedProcess:
    from tests.support.fresh import PRELUDE, ROOT

    script = "\n".join(textwrap.dedent(part) for part in (PRELUDE, *parts))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MBX_LOG_LEVEL="WARNING")
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_upstream_leaves_a_peft_override_it_cannot_build_as_a_dict_and_goes_on():
    done = _run_script("from megatron_bridge_ext.patches import bridge_peft_without_te\n"
                       "bridge_peft_without_te.import_bridge_peft()", OVERRIDE_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'RESULT {"peft": "DictConfig"}' in done.stdout or 'RESULT {"peft": "dict"}' in done.stdout


def test_after_init_a_misspelt_strategy_override_stops_the_run_with_one_line():
    done = _run_script("import megatron_bridge_ext\nfrom megatron_bridge_ext.levers import allocator\n"
                       "allocator.init = lambda **options: None\nmegatron_bridge_ext.init()", OVERRIDE_SCRIPT)
    assert done.returncode == 1 and "RESULT" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_bridge_ext: peft override not built: ")
    assert "'shard_lcoal'" in last and "did you mean 'shard_local'" in last
    assert not [line for line in done.stderr.splitlines() if line.startswith("Traceback")]  # ours: no traceback
