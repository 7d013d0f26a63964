"""bridge_truthful_te_detection: Bridge's LoRA() on Megatron Core's tensor-parallel linears without Transformer Engine."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.patches.base import APPLIED
from tests.support.fresh import run
from tests.support.patches import without_te

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# bridge_truthful_te_detection: LoRA() on Megatron Core's tensor-parallel linears
# --------------------------------------------------------------------------------------------

# One process, world size 1, TP=1; the CPU emulation goes in before Megatron Core's layers import.
LORA_SETUP = """
import tempfile

from megatron_bridge_ext.testing import cpu_emulation

cpu_emulation.install()
import torch
import torch.distributed as dist
from torch import nn

from megatron_bridge_ext.patches import bridge_peft_without_te, bridge_truthful_te_detection

assert bridge_peft_without_te.PATCH.apply()[0] == "applied"
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/rendezvous", rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

parallel_state.initialize_model_parallel()
from megatron.bridge.peft import utils as peft_utils
from megatron.bridge.peft.lora import LoRA
from megatron.bridge.peft.lora_layers import LoRALinear


def model():
    config = ModelParallelConfig(use_cpu_initialization=True)
    init = nn.init.xavier_normal_
    m = nn.Module()
    m.linear_qkv = ColumnParallelLinear(8, 12, config=config, init_method=init, bias=False, gather_output=False)
    m.linear_proj = RowParallelLinear(12, 8, config=config, init_method=init, bias=False, input_is_parallel=True,
                                      skip_bias_add=True)
    return m


def transform():
    '''(model with LoRA on both linears, None) or (None, the TypeError's text).'''
    try:
        out = LoRA(target_modules=["linear_qkv", "linear_proj"], dim=4, alpha=8)(model(), training=True)
    except TypeError as exc:
        return None, str(exc)
    return (out[0] if isinstance(out, list) else out), None
"""


@without_te
def test_upstream_lora_transform_fails_on_core_parallel_linears():
    result = run(LORA_SETUP, """
        out, error = transform()
        report(error=error, have_te=peft_utils.HAVE_TE)
    """)
    assert result["have_te"] is True  # Core's TE placeholder classes make Bridge believe TE is there
    assert result["error"] is not None, "upstream LoRA() was expected to raise TypeError"
    assert "isinstance" in result["error"]


@without_te
def test_patched_lora_transform_wraps_core_parallel_linears_and_revert_restores_upstream():
    result = run(LORA_SETUP, """
        status = bridge_truthful_te_detection.PATCH.apply()
        out, error = transform()
        y, _ = out.linear_qkv(torch.randn(3, 2, 8))
        patched = dict(
            status=status[0], error=error,
            types=[type(out.linear_qkv).__name__, type(out.linear_proj).__name__],
            lora_linear=[isinstance(out.linear_qkv, LoRALinear), isinstance(out.linear_proj, LoRALinear)],
            trainable=sorted(n for n, p in out.named_parameters() if p.requires_grad),
            out_shape=list(y.shape),
        )
        bridge_truthful_te_detection.PATCH.revert()
        _, error_after_revert = transform()
        report(**patched, have_te_after_revert=peft_utils.HAVE_TE, error_after_revert=error_after_revert)
    """)
    assert result["status"] == APPLIED
    assert result["error"] is None
    assert result["types"] == ["LoRALinear", "LoRALinear"]
    assert result["lora_linear"] == [True, True]
    assert result["trainable"] and all(".adapter." in name for name in result["trainable"])  # base weights frozen
    assert result["out_shape"] == [3, 2, 12]
    assert result["have_te_after_revert"] is True
    assert result["error_after_revert"] is not None and "isinstance" in result["error_after_revert"]
