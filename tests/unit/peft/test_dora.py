"""Our DoRA's own rule: Bridge's path kept only for adapter dropout on a TE LayerNorm-linear."""

from __future__ import annotations

import pytest

from tests.support.peft import _adapter, _split_wrapper

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("te, dropout, refused", [(True, True, True), (True, False, False), (False, True, False)])
def test_dora_keeps_bridges_path_only_for_dropout_on_a_te_layernorm_linear(classes, te, dropout, refused):
    from megatron_bridge_ext.peft.dora import TE_DROPOUT_REASON

    wrapper = _split_wrapper({}, te=te)
    wrapper.adapter = _adapter(dropout=dropout)
    reason = classes["dora"][1]()._kind_reason(wrapper)
    assert reason == (TE_DROPOUT_REASON if refused else None)
