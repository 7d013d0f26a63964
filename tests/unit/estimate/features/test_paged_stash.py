"""The MoE paged stash is refused by name, and only when it is on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate import features
from megatron_bridge_ext.estimate.features import paged_stash

pytestmark = [pytest.mark.unit]


def test_the_stash_is_one_finding_naming_its_setting():
    [finding] = paged_stash.findings(SimpleNamespace(moe_paged_stash=True))
    assert finding.setting == "model.moe_paged_stash"
    assert paged_stash.findings(SimpleNamespace(moe_paged_stash=False)) == []


def test_the_estimate_asks_it():
    assert paged_stash in features.FEATURES


def test_the_stash_core_0_19_has_is_the_one_refused():
    """Core 0.19's TransformerConfig has the field the finding names."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert "moe_paged_stash" in TransformerConfig.__dataclass_fields__
