"""Proof at run time that selective ``core_attn`` recompute took effect."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron_bridge_ext.measure.modules import in_backward

log = logging.getLogger(__name__)

_TARGET = "_checkpointed_attention_forward"
_MISSING = object()


class RecomputeProbe:
    """Counts checkpointed core-attention forwards and their recomputation in backward.

    Use around training steps: ``checkpointed_forwards`` counts calls of Megatron Core's
    ``Attention._checkpointed_attention_forward``; ``recomputed`` counts core-attention forwards that
    ran inside the backward pass (the recomputation). Both equal the number of layers per step when
    ``core_attn`` recompute is active, and 0 when it is not.

    Probes nest in any order: the first one entered wraps the method once, every active probe
    counts through that one wrapper, and the last one to exit puts back exactly what was there
    (the class's own attribute, or no attribute when the method was inherited).
    """

    _active: list["RecomputeProbe"] = []
    _saved = _MISSING  # what Attention.__dict__ held before the wrapper
    _wrapper = None

    def __init__(self, model: Optional[torch.nn.Module] = None) -> None:
        self.model = model
        self.checkpointed_forwards = 0
        self.recomputed = 0
        self._handles: list = []

    @staticmethod
    def _attention_class():
        from megatron.core.transformer.attention import Attention

        return Attention

    @classmethod
    def _install(cls) -> None:
        attention = cls._attention_class()
        cls._saved = attention.__dict__.get(_TARGET, _MISSING)
        original = getattr(attention, _TARGET)

        def counted(module, *args, **kwargs):
            for probe in RecomputeProbe._active:
                probe.checkpointed_forwards += 1
            return original(module, *args, **kwargs)

        cls._wrapper = counted
        setattr(attention, _TARGET, counted)

    @classmethod
    def _uninstall(cls) -> None:
        attention = cls._attention_class()
        if attention.__dict__.get(_TARGET) is not cls._wrapper:
            log.warning("Attention.%s was replaced while a RecomputeProbe was active; left as it is", _TARGET)
        elif cls._saved is _MISSING:
            delattr(attention, _TARGET)
        else:
            setattr(attention, _TARGET, cls._saved)
        cls._saved, cls._wrapper = _MISSING, None

    def __enter__(self) -> "RecomputeProbe":
        if not RecomputeProbe._active:
            RecomputeProbe._install()
        RecomputeProbe._active.append(self)
        if self.model is not None:
            for name, module in self.model.named_modules():
                if name.endswith("core_attention"):
                    self._handles.append(module.register_forward_pre_hook(self._on_core_attention))
        return self

    def _on_core_attention(self, module, args) -> None:
        if in_backward():
            self.recomputed += 1

    def __exit__(self, *exc) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        RecomputeProbe._active.remove(self)
        if not RecomputeProbe._active:
            RecomputeProbe._uninstall()
        return False

    def as_dict(self) -> dict:
        return {"checkpointed_forwards": self.checkpointed_forwards, "recomputed": self.recomputed}
