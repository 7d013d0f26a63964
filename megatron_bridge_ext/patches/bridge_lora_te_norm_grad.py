"""Bridge's LoRA on a Transformer Engine LayerNorm-linear under sequence parallelism gets its input gradient.

Megatron Bridge (0.5.1 ``peft/utils.py`` L576, 0.6.2 L611, ``get_adapter_attributes_from_linear``)
sets ``return_layernorm_output_gathered=True`` on TE's ``LayerNormColumnParallelLinear`` under
sequence parallelism and feeds that gathered LayerNorm output to LoRA-A (``LoRALinear``,
``DoRALinear`` and CanonicalLoRA's split wrappers all take it from
``AdapterWrapper.base_linear_forward``). Up to TE 2.3 TE's backward added the gradient of that
returned gathered tensor to its input gradient before the reduce-scatter; TE commit ce0b46c4d
(first in TE 2.4, still so at TE main) removed the addition: TE now uses that gradient only when
the norm output is returned *not* gathered (``layernorm_linear.py``, v2.4 L895-898). So with
TE >= 2.4 the gradient the LoRA branch sends back to its input is dropped in every layer whose
``linear_qkv`` or ``linear_fc1`` has an adapter: no error, a silently worse fine-tune.

The patch wraps ``AdapterWrapper.base_linear_forward`` (the same method in Bridge 0.5.1 and 0.6.2):
for a wrapper whose TE LayerNorm-linear was set up to return the gathered norm output, it asks TE
for the local shard instead (the branch whose gradient TE still adds) and all-gathers it with
Megatron Core's ``gather_from_sequence_parallel_region``, whose backward reduce-scatters the
gradient. The adapters get the same gathered tensor as before (one per wrapper, shared by
CanonicalLoRA's adapters) and autograd keeps the same tensors; the cost is one all-gather in
forward and one reduce-scatter in backward of [s, b, h] per such layer. Wrappers that already use
the shard (Bridge's ``sequence_parallel_input_regather``, megatron_bridge_ext's strategies) and
adapters that gather by themselves are left alone.
"""

from __future__ import annotations

import logging
from typing import Callable

from packaging.version import Version

from megatron_bridge_ext import versions
from megatron_bridge_ext.patches.base import Patch

log = logging.getLogger("megatron_bridge_ext.patches")

FIRST_AFFECTED_TE = Version("2.4.0.dev0")
"""TE's version was already 2.4.0.dev0 before ce0b46c4d: every 2.4 dev build counts as affected."""

_DECISION = "_mbx_gather_norm_output"


def te_affected() -> tuple[bool, str]:
    """Whether the installed Transformer Engine drops the gradient of a gathered returned norm output."""
    version = versions.installed_version("transformer-engine")
    if version is None:
        return False, "Transformer Engine is not installed"
    if version >= FIRST_AFFECTED_TE:
        return True, f"Transformer Engine {version} (>= 2.4) drops the gradient of a gathered returned norm output"
    return False, f"Transformer Engine {version} (< 2.4) adds the gradient of the gathered norm output itself"


def _adapters_gather_themselves(wrapper) -> bool:
    """True when an adapter of ``wrapper`` all-gathers its own input (then it must get the shard)."""
    from megatron.bridge.peft.utils import ParallelLinearAdapter

    return any(isinstance(m, ParallelLinearAdapter) and not m.disable_sequence_parallel_comm
               for m in wrapper.adapter.modules())


def _decide(wrapper) -> bool:
    """At a wrapper's first forward: does its base return the gathered norm output under SP on an affected TE?"""
    base = wrapper.to_wrap
    return bool(
        getattr(base, "return_layernorm_output", False)
        and getattr(base, "return_layernorm_output_gathered", False)
        and getattr(base, "sequence_parallel", False)
        and te_affected()[0]
    )


def _wrap(original: Callable) -> Callable:
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    logged = []

    def base_linear_forward(self, x, *args, **kwargs):
        decision = self.__dict__.get(_DECISION)
        if decision is None:
            decision = self.__dict__[_DECISION] = _decide(self)
            if decision and not logged:
                logged.append(True)
                log.info("LoRA on a TE LayerNorm-linear under sequence parallelism: the norm output is returned "
                         "as the local shard and all-gathered by megatron_bridge_ext, because Transformer Engine "
                         ">= 2.4 drops the gradient of a gathered return (logged once)")
        if not decision:
            return original(self, x, *args, **kwargs)
        base = self.to_wrap
        base.return_layernorm_output_gathered = False  # Bridge's conversion code may set it back: every call
        linear_output, bias, layernorm_output = original(self, x, *args, **kwargs)
        if not _adapters_gather_themselves(self):
            group = getattr(base, "_tp_group", None) or getattr(base, "tp_group", None)  # Core's, then TE's name
            layernorm_output = gather_from_sequence_parallel_region(layernorm_output, group=group)
        return linear_output, bias, layernorm_output

    base_linear_forward.__doc__ = original.__doc__
    base_linear_forward.__wrapped__ = original
    return base_linear_forward


def _needed() -> tuple[bool, str]:
    return te_affected()


def _apply() -> Callable[[], None]:
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    original = AdapterWrapper.__dict__["base_linear_forward"]
    AdapterWrapper.base_linear_forward = _wrap(original)

    def undo() -> None:
        AdapterWrapper.base_linear_forward = original

    return undo


PATCH = Patch(
    name="bridge_lora_te_norm_grad",
    target="megatron.bridge.peft.adapter_wrapper.AdapterWrapper.base_linear_forward",
    distribution="megatron-bridge",
    versions=">=0.5.1,<=0.6.2",
    reason="with Transformer Engine >= 2.4 (TE commit ce0b46c4d) the LoRA branch's input gradient is dropped "
           "when Bridge feeds LoRA-A TE's gathered LayerNorm output under sequence parallelism",
    applied_by="megatron_bridge_ext.peft's LoRA, DoRA and CanonicalLoRA when they transform a model, and "
               "MemoryConfig.apply for any LoRA-family cfg.peft (Bridge's own included)",
    needed=_needed,
    do_apply=_apply,
)
