"""Megatron Core's local layer spec accepts sequence parallelism in its norms.

``megatron.core.transformer.torch_norm.WrappedTorchNorm`` asserts ``not config.sequence_parallel``,
so the local (non-TE) spec cannot run with SP. LayerNorm and RMSNorm are per-token: on a sequence
shard they compute exactly what they compute on the whole sequence. What SP does require is that
their parameter gradients, each from a different sequence shard, are summed across the TP group.
Megatron Core does that for every parameter marked ``sequence_parallel=True`` (as TE norms are), so
the patch builds the norm and marks its parameters. All other assertions are kept.
"""

from __future__ import annotations

from typing import Callable

from megatron_bridge_ext.patches.base import Patch


def _wrapped_norm_class():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def _needed() -> tuple[bool, str]:
    import inspect

    source = inspect.getsource(_wrapped_norm_class().__new__)
    if "sequence_parallel" in source:
        return True, "WrappedTorchNorm asserts `not config.sequence_parallel`"
    return False, "WrappedTorchNorm does not refuse sequence parallelism"


def _apply() -> Callable[[], None]:
    cls = _wrapped_norm_class()
    original_new = cls.__dict__["__new__"]

    def __new__(klass, config, hidden_size, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if not sequence_parallel:
            return original_new(klass, config, hidden_size, *args, **kwargs)
        config.sequence_parallel = False  # only for the duration of the upstream checks
        try:
            norm = original_new(klass, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__.__doc__ = "WrappedTorchNorm that accepts sequence parallelism (megatron-bridge-ext patch)."
    cls.__new__ = staticmethod(__new__)

    def undo() -> None:
        cls.__new__ = original_new

    return undo


PATCH = Patch(
    name="core_local_norm_sequence_parallel",
    target="megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
    distribution="megatron-core",
    versions=">=0.17,<0.20",
    reason="the local spec's norm refuses SP although it is per-token; its params need sequence_parallel=True",
    applied_by="megatron_bridge_ext.testing when it builds a local-spec model with sequence parallelism (its tiny "
               "model, or a Bridge recipe shrunk by testing.bridge.recipe.tiny_gpt)",
    needed=_needed,
    do_apply=_apply,
)
