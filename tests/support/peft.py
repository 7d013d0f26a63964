"""What the PEFT configuration tests share: our classes as module-scoped fixtures, and stand-ins for Bridge's adapters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_bridge_ext.peft import kinds

FIELD = "sequence_parallel_input_strategy"
NEW_KINDS = ("dora", "canonical_lora")


def _adapter(*, trainable=True, dropout=False):
    config = SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2)
    return SimpleNamespace(
        base_linear_name="decoder.layers.0.self_attention.linear_qkv", input_is_parallel=False, tp_group=None,
        config=config, linear_in=SimpleNamespace(weight=torch.zeros(2, 2, requires_grad=trainable)),
        activation=nn.Identity(), dropout=nn.Dropout(0.1) if dropout else nn.Identity(), dropout_position="pre")


def _split_wrapper(adapters: dict, te=False):
    """CanonicalLoRA's linear_qkv wrapper as eligibility reads it: the base and its adapters by key."""
    base = SimpleNamespace(config=SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2),
                           sequence_parallel=True, parallel_mode="column")
    if te:
        base.return_layernorm_output_gathered = False
    return SimpleNamespace(to_wrap=base, adapter=SimpleNamespace(**adapters))


@pytest.fixture(scope="module")
def ours():
    """Our LoRA class. Importing it applies the upstream patches to this process; they are reverted
    when this module's tests are done, so that later tests in the process find upstream unpatched."""
    from megatron_bridge_ext.patches import revert_all
    from megatron_bridge_ext.peft import LoRA

    yield LoRA
    revert_all()


@pytest.fixture(scope="module")
def classes():
    """(Bridge's class, ours) per new kind. Importing ours applies upstream patches to this process; they
    are reverted when this module's tests are done, so that later tests find upstream unpatched."""
    from megatron_bridge_ext.patches import revert_all

    yield {kind: (kinds.bridge_class(kind), kinds.our_class(kind)) for kind in NEW_KINDS}
    revert_all()
