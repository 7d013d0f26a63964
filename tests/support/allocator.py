"""What the allocator tests share: the torch versions whose readers differ, and the plan on an environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from megatron_bridge_ext.levers.allocator import ALLOC_VAR, CUDA_VAR, plan_allocator

ROOT = Path(__file__).resolve().parents[2]
NEW = "2.14.1"  # the installed torch
ES = "expandable_segments:True"


def plan(env, version=NEW, **kw):
    return plan_allocator(env, torch_version=version, **kw)


def codes(findings, level=None):
    return [f.code for f in findings if level is None or f.level == level]


_CHILD = """
import json, os, sys
import megatron_bridge_ext
result = megatron_bridge_ext.init()
at_init = {"torch_imported": "torch" in sys.modules,
           "env": {k: os.environ.get(k) for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}}
import torch
at_init["cuda_initialized_after_import"] = torch.cuda.is_initialized()
at_init["torch_reads"] = torch._C._accelerator_getAllocatorSettings()
at_init["result"] = result.to_dict()
print(json.dumps(at_init))
"""


def _child(env_overrides: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (CUDA_VAR, ALLOC_VAR, "MBX_ALLOCATOR_IPC")}
    env.update(env_overrides)
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cfg(env_vars=None, nccl_ub=False, cuda_graph_impl="none"):
    return SimpleNamespace(env_vars=dict(env_vars or {}), ddp=SimpleNamespace(nccl_ub=nccl_ub),
                           model=SimpleNamespace(cuda_graph_impl=cuda_graph_impl))


def _bridge_applies(cfg, shell: dict) -> dict:
    """What Bridge 0.6.2 does with cfg.env_vars (setdefault: the shell wins); checked by the next test."""
    env = dict(shell)
    for name, value in cfg.env_vars.items():
        env.setdefault(name, str(value))
    return env
