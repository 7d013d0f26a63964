"""The module stack the meters share: which named module's forward is running."""

from __future__ import annotations

import pytest
from torch import nn

from megatron_bridge_ext.measure import ROOT, ModuleStack

pytestmark = [
    pytest.mark.unit,
    # torch marks all_gather_into_tensor & co. deprecated; Megatron Core still calls them.
    pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning"),
]


def test_module_stack_outside_forward_is_root():
    stack = ModuleStack(nn.Linear(2, 2))
    assert stack.current() == ROOT
