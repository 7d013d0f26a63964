"""An experimental attention variant on a model without multi-latent attention other than the gated delta net is
refused by name, not traced as softmax attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate import features
from megatron_bridge_ext.estimate.features import attention_variant

pytestmark = [pytest.mark.unit]


def test_gated_delta_net_is_modelled_and_raises_nothing():
    """Qwen3-Next's and Qwen3.5's providers set the variant (Bridge qwen3_next_bridge.py L85, qwen35_bridge.py L61)."""
    model = SimpleNamespace(experimental_attention_variant="gated_delta_net", multi_latent_attention=False)
    assert attention_variant.findings(model) == []


def test_another_variant_without_multi_latent_attention_is_refused_by_name():
    model = SimpleNamespace(experimental_attention_variant="dsa", multi_latent_attention=False)
    (finding,) = [f for f in features.findings(model) if f.setting == "model.experimental_attention_variant"]
    assert "'dsa' attention variant" in finding.message and "not modelled" in finding.message


@pytest.mark.parametrize("model", [SimpleNamespace(experimental_attention_variant=None, multi_latent_attention=False),
                                   SimpleNamespace(multi_latent_attention=False)])
def test_a_model_without_a_variant_raises_nothing(model):
    assert attention_variant.findings(model) == []
