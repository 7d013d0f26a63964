"""The estimate next to a measured run (CPU tests; GPU device check).

An estimate's saved-activation bytes per microbatch compare with ``SavedActivationMeter`` on a real
run (to the byte on CPU ranks), its peak with ``torch.cuda.max_memory_allocated`` on a GPU
(:class:`PeakComparison`). The model measured is the harness's
(:func:`megatron_bridge_ext.testing.tiny_model.tiny_config` builds its Bridge config); nothing here
depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.estimate.report import MemoryEstimate

PEAK_TARGET = 0.05
"""The estimate's peak should be within 5% of ``max_memory_allocated`` on a GPU."""


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
    s = est.settings
    return {"tp": s.tp, "pp": s.pp, "dp": s.dp, "seq_length": s.seq_length, "micro_batch": s.micro_batch}
