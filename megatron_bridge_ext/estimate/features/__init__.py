"""The model features the estimate knows, one module each: how to detect the feature in a model config, what it
keeps (traced on Megatron Core's layer where Core runs it here, else a formula from the kernel's cited source),
and the findings it raises for a variant it does not model.

The estimate grows by features, not by model names: DeepSeek, Kimi, Moonlight and GLM share multi-latent
attention, multi-token prediction, the ``flex`` dispatcher and FP8 on their experts. :func:`findings` is what
:mod:`..memory` asks before it builds a rank's model; each feature module owns its own refusals.
"""

from __future__ import annotations

from megatron_bridge_ext.estimate.features import (context_parallel, dispatcher, fp8_experts, latent_moe, mla, moe_act,
                                                   mtp, token_dropping)
from megatron_bridge_ext.findings import Finding

FEATURES = (mla, mtp, context_parallel, dispatcher, token_dropping, latent_moe, moe_act, fp8_experts)
"""Every feature module, each with ``findings(model) -> list[Finding]``."""


def findings(model) -> list[Finding]:
    """What the features of ``model`` that the estimate does not model say, one finding each (empty: all modelled)."""
    return [finding for feature in FEATURES for finding in feature.findings(model)]
