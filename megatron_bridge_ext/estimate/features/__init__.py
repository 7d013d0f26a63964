"""The model features the estimate knows, one module each: how to detect the feature in a model config, what it
keeps (traced on Megatron Core's layer where Core runs it here, else a formula from the kernel's cited source),
and the findings it raises for a variant it does not model.

The estimate grows by features, not by model names: DeepSeek, Kimi, Moonlight and GLM share multi-latent
attention, multi-token prediction, the ``flex`` dispatcher and FP8 on their experts. :func:`findings` is what
:mod:`..memory` asks before it builds a rank's model; each feature module owns its own refusals.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from megatron_bridge_ext.estimate.features import (activation_offload, attention_variant, context_parallel,
                                                   cross_entropy, dispatcher, dsa, flex, flex_attention, fp8_experts,
                                                   gated_delta_net, hybridep, latent_moe, mla, moe_act, mtp,
                                                   paged_stash, recipe_attention, router, softmax, token_dropping)
from megatron_bridge_ext.findings import Finding

FEATURES = (mla, dsa, attention_variant, mtp, context_parallel, dispatcher, token_dropping, latent_moe, moe_act,
            fp8_experts, activation_offload, paged_stash)
"""Every feature module, each with ``findings(model) -> list[Finding]``."""
KERNELS = (softmax, cross_entropy, router, flex_attention, gated_delta_net)
"""The feature modules that stand in for a GPU kernel Core calls, each with ``kernels()`` (a context in which Core
finds the stand-in), ``used(model)`` and ``NOTE`` (what the estimate says it traced)."""


def findings(model) -> list[Finding]:
    """What the features of ``model`` that the estimate does not model say, one finding each (empty: all modelled)."""
    return [finding for feature in FEATURES for finding in feature.findings(model)]


@contextlib.contextmanager
def kernels() -> Iterator[None]:
    """While a rank's model is traced, Core finds every kernel stand-in of :data:`KERNELS` where it calls the kernel."""
    with contextlib.ExitStack() as stack:
        for feature in KERNELS:
            stack.enter_context(feature.kernels())
        yield


def kernel_notes(model, *, unfused_attention: bool) -> list[str]:
    """What the estimate says of each kernel of ``model`` it traced by a stand-in (the softmax only in unfused
    attention: the fused attention stand-in has none; FlexAttention only in fused attention: the unfused trace keeps
    its unfused parent)."""
    only = {softmax: True, flex_attention: False}
    return [feature.NOTE for feature in KERNELS
            if feature.used(model) and only.get(feature, unfused_attention) == unfused_attention]
