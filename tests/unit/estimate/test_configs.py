"""Configs to estimate: a config.json's shape fields below one are refused before the model is built."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate import configs
from megatron_bridge_ext.findings import Refused
from tests.support.estimate import QWEN3_8B

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def qwen_tp2():
    return configs.from_hf_config(QWEN3_8B, configs.Layout(tp=2, seq=1024))


@pytest.mark.parametrize("field", list(configs.SHAPE_FIELDS))
@pytest.mark.parametrize("value", [0, -8])
def test_a_shape_field_below_one_is_refused_before_the_model_is_built(qwen_tp2, field, value):
    """However the value came (a recipe's default, an override), the estimate refuses it by name before
    Megatron Core divides by it."""
    import copy

    from megatron_bridge_ext.estimate import estimate

    cfg = copy.deepcopy(qwen_tp2)
    setattr(cfg.model, field, value)
    with pytest.raises(Refused) as refused:
        estimate(cfg)
    assert refused.value.one_line() == f"model.{field}: is {value}. Fix: set it to a whole number of 1 or more"
