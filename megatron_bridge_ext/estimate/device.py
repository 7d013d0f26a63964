"""The estimate next to a measured run of the demo's tiny model (CPU tests; GPU device check).

:func:`tiny_config` turns a :class:`~megatron_bridge_ext.testing.tiny_model.TinyGPTShape` into the Bridge
config whose model is exactly the one ``tiny_model.build_gpt`` builds (same Megatron Core
TransformerConfig fields, same vocabulary, untied output layer), so that ``estimate(tiny_config(...))``
can be compared with ``SavedActivationMeter`` on a real run (to the byte on CPU ranks) or with
``torch.cuda.max_memory_allocated`` on a GPU (:class:`PeakComparison`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.estimate.report import MemoryEstimate

PEAK_TARGET = 0.05
"""The estimate's peak should be within 5% of ``max_memory_allocated`` on a GPU."""


def tiny_config(shape, peft=None, **config_overrides):
    """A Bridge ConfigContainer for the tiny model of ``shape`` (PEFT object and extra config fields as the demo)."""
    from megatron_bridge_ext.testing import tiny_model
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config
    from megatron.core.transformer.transformer_config import TransformerConfig

    core = tiny_model.transformer_config(shape, **config_overrides)
    fields = {f.name: getattr(core, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
    fields["transformer_impl"] = "local"  # the demo builds Megatron Core's local layer spec
    provider = GPTModelProvider(**fields, vocab_size=shape.vocab, seq_length=shape.seq,
                                share_embeddings_and_output_weights=False, position_embedding_type="rope")
    cfg = vanilla_gpt_pretrain_config()
    cfg.model, cfg.peft = provider, peft
    cfg.mixed_precision = None  # the tiny config's fields already carry its dtype
    cfg.train.micro_batch_size = shape.micro_batch
    cfg.train.global_batch_size = shape.micro_batch
    return cfg


@dataclass(frozen=True)
class PeakComparison:
    estimate_bytes: int
    measured_bytes: int
    excluded: tuple[str, ...]
    target: float

    @property
    def relative_error(self) -> float:
        return (self.estimate_bytes - self.measured_bytes) / self.measured_bytes

    @property
    def within_target(self) -> bool:
        return abs(self.relative_error) <= self.target


def saved_per_microbatch(est: MemoryEstimate) -> int:
    """The bytes one microbatch saved for backward in the estimate's trace (what the meter reads on a real run)."""
    return sum(est.activations_per_microbatch.values())


def layout_of(est: MemoryEstimate) -> dict[str, Optional[int]]:
    """The estimate's parallel layout, for reports next to a measurement."""
    return {k: est.settings[k] for k in ("tp", "pp", "dp", "seq_length", "micro_batch")}
