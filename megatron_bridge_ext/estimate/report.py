"""What the estimate returns: a table of components, each with its bytes and what they rest on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_bridge_ext.estimate.settings import Settings
from megatron_bridge_ext.sizes import GB, GIB, gib  # noqa: F401  (the units of the report, defined once)
from megatron_bridge_ext.table import text_table

STATIC = "static"
ACTIVATIONS = "activations"
BUFFERS = "buffers"
TRANSIENT = "transient"
KINDS = (STATIC, ACTIVATIONS, BUFFERS, TRANSIENT)

@dataclass(frozen=True)
class Component:
    """One line of the estimate: ``kind`` is static, activations, buffers or transient.

    ``basis`` says where the bytes come from: the formula with its inputs, or the measurement.
    """

    kind: str
    name: str
    bytes: int
    basis: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Component.kind={self.kind!r} is not one of {KINDS}")


@dataclass
class MemoryEstimate:
    """Per-rank memory of one pipeline stage's TP rank 0, in the steady state and by phase.

    ``components`` are the steady state's: every static, activation and buffer component plus the
    largest transient (the transients are alive at different moments of the step, the loss, one
    layer's backward, not together). ``step`` says what the optimizer's step holds and allocates, from
    which :mod:`.phases` derives iteration 1 (no moments yet) and the first step; ``peak_bytes`` is the
    largest phase's peak (``peak_phase`` names it). ``stage_phase_peaks``: every estimated stage's
    phases, name -> (peak bytes, bytes alive after the phase).
    """

    stage: int
    components: list[Component]
    settings: Settings
    assumptions: list[str]
    activations_per_microbatch: dict[str, int]
    in_flight_microbatches: float
    activations_per_layer: dict[int, int] = field(default_factory=dict)
    stage_peaks: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    step: Optional[Any] = None
    stage_phase_peaks: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    graph_buffers: Optional[Component] = None
    """The static buffers of the config's captured CUDA graphs (:mod:`.cuda_graphs`), alive from the capture on: the
    ``CUDA-graph capture`` phase holds them."""
    stage_graph_pools: dict[int, Any] = field(default_factory=dict)
    """Every estimated stage's predicted CUDA-graph pool (:func:`.phases.graph_pool`, None without per-layer graphs)."""
    offload_host_bytes: int = 0
    """The pinned host bytes fine-grained activation offloading copies per microbatch in the steady state (what the
    step-time model sends over the host link, :mod:`megatron_bridge_ext.levers.activation_offload.cost`)."""

    def total(self, kind: str) -> int:
        return sum(c.bytes for c in self.components if c.kind == kind)

    @property
    def largest_transient(self) -> Component | None:
        transients = [c for c in self.components if c.kind == TRANSIENT]
        return max(transients, key=lambda c: c.bytes) if transients else None

    @property
    def steady_peak_bytes(self) -> int:
        """Static + activations + buffers + the largest transient: the steady state's peak."""
        transient = self.largest_transient
        return self.total(STATIC) + self.total(ACTIVATIONS) + self.total(BUFFERS) + (transient.bytes if transient else 0)

    @property
    def phases(self) -> list:
        from megatron_bridge_ext.estimate import phases

        return phases.phases(self)

    @property
    def peak_phase(self):
        """The phase with the largest peak (the steady state on a tie: the later phase holds it as long)."""
        return _largest_phase(self.phases)

    @property
    def peak_bytes(self) -> int:
        """The largest phase's peak: what the device must hold at some point of the run."""
        return self.peak_phase.peak_bytes

    def element_size(self) -> int:
        """Bytes per element of the activations (the ``dtype`` setting): the unit of the plan's traffic costs."""
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.settings.dtype]

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def table(self, *, basis: bool = True) -> str:
        """The components as a text table, with subtotals and the peak."""
        largest = self.largest_transient
        rows = []
        for kind in KINDS:
            for c in (c for c in self.components if c.kind == kind):
                mark = " (largest)" if c is largest else ""
                rows.append([kind, c.name + mark, gib(c.bytes)] + ([c.basis] if basis else []))
        rows.append(self._peak_row(basis))
        columns = ["kind", "component", "bytes"] + (["basis"] if basis else [])
        return text_table(columns, rows)

    def _peak_row(self, basis: bool) -> list[str]:
        """The largest phase's peak, the one the verdict names: the steady state's sum of the rows above, or
        another phase (the first optimizer step, say) by its name and what it holds."""
        from megatron_bridge_ext.estimate.phases import STEADY  # phases builds on this module

        phase = self.peak_phase
        unit = f"({phase.peak_bytes / GB:.3f} GB, the unit of Bridge's published peaks)"
        if phase.name == STEADY:
            return ["peak", "static + activations + buffers + largest transient", gib(phase.peak_bytes)] + (
                [unit] if basis else [])
        return ["peak", f"{phase.name} (the largest phase)", gib(phase.peak_bytes)] + (
            [f"{phase.basis} {unit}"] if basis else [])

    def phase_table(self) -> str:
        """Every phase's peak (GiB and GB) and what it holds, the largest marked."""
        phases = self.phases  # built anew on each read: the mark compares within this one list
        largest = _largest_phase(phases)
        rows = [[p.name + (" (largest)" if p is largest else ""), gib(p.peak_bytes), f"{p.peak_bytes / GB:.3f} GB",
                 p.basis] for p in phases]
        return text_table(["phase", "peak", "peak (GB)", "holds"], rows)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["settings"] = self.settings.to_json()
        out["peak_bytes"] = self.peak_bytes
        out["steady_peak_bytes"] = self.steady_peak_bytes
        out["peak_phase"] = self.peak_phase.name
        out["phases"] = [p.as_dict() for p in self.phases]
        from megatron_bridge_ext.estimate.phases import predicted_reports

        out["predicted_reports"] = [dict(vars(r), max_allocated_gigabytes=r.max_allocated_gigabytes,
                                         allocated_gigabytes=r.allocated_gigabytes) for r in predicted_reports(self)]
        out["totals"] = {kind: self.total(kind) for kind in KINDS}
        return out


def _largest_phase(phases: list):
    """The phase with the largest peak; on a tie the later one (it holds the peak as long)."""
    return max(reversed(phases), key=lambda p: p.peak_bytes)
