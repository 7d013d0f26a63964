"""What the patch tests share: the skip marks for what upstream finds installed, and the scripts several scenarios run.

Imports are process-global (a module imported once stays imported, a patched class stays patched), so every
scenario runs in a fresh interpreter (``tests.support.fresh.run``); only the version-gate tests run in the test
process: an out-of-range patch imports nothing.
"""

from __future__ import annotations

import importlib.util

import pytest

from megatron_bridge_ext.patches import bridge_prebuilt_dataset_helpers

TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None
without_te = pytest.mark.skipif(TE_INSTALLED, reason="Transformer Engine is installed: upstream imports and detects it")
without_nvrx = pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is not None,
                                  reason="nvidia-resiliency-ext is installed: Bridge's pretrain.py imports it")

_DATASETS = bridge_prebuilt_dataset_helpers.core_datasets_dir()
wheel_helpers = pytest.mark.skipif(
    _DATASETS is None or (_DATASETS / "Makefile").exists(),
    reason="Megatron Core's datasets directory has a Makefile (a source install): upstream builds the helpers")

BRIDGE_WITHOUT_TE = '''
from megatron_bridge_ext.patches import bridge_peft_without_te


def import_bridge():
    """Import Megatron Bridge as our LoRA does (Transformer Engine is another patch's matter)."""
    bridge_peft_without_te.import_bridge_peft()


def upstream_loaded():
    return sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "megatron"))
'''
