"""What each lever's advice is made of: an option with its cost, the state the levers reach, and the checks.

The planner (:mod:`megatron_bridge_ext.planner`) walks the levers in decision order; each lever's
``advice`` module turns a :class:`State` into options (recorded through the planner) and the state
the next lever starts from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_bridge_ext import evidence
from megatron_bridge_ext.estimate.report import ACTIVATIONS, BUFFERS, STATIC, MemoryEstimate, gib
from megatron_bridge_ext.findings import ERROR, NO_EFFECT, Finding, Refused


def evidence_for(name: str) -> dict:
    """The published cost and source of the lever ``name`` (:data:`megatron_bridge_ext.evidence.LEVERS`)."""
    for lever in evidence.LEVERS:
        if lever["name"] == name:
            return lever
    raise KeyError(name)


@dataclass
class Cost:
    """What an option costs per training step on one rank."""

    collective_bytes: Optional[int] = None
    """Change in bytes this rank moves per step (negative: fewer), with the formula in ``basis``."""
    recomputed_flops: Optional[int] = None
    pcie_bytes: Optional[int] = None
    """Bytes to the host and back over PCIe per step (CPU offloading)."""
    step_time_pct: Optional[float] = None
    """Predicted step-time change of the option's config against the config as is, in percent
    (:mod:`megatron_bridge_ext.levers.steptime`; positive: slower)."""
    published: str = ""
    source: str = ""
    basis: str = ""

    def measured(self) -> str:
        """The computed costs in a few words (the published figure is listed apart, with its source)."""
        parts = []
        if self.collective_bytes is not None:
            sign = "+" if self.collective_bytes >= 0 else "-"
            parts.append(f"collectives {sign}{gib(abs(self.collective_bytes))}/step")
        if self.recomputed_flops:
            parts.append(f"recompute +{self.recomputed_flops / 1e12:,.2f} TFLOP/step")
        return "; ".join(parts) or ("see published figure" if self.published else "none")


@dataclass
class Option:
    """One step of the procedure: what it sets, the predicted peak after it, its cost and constraints.

    ``label`` names the option in a few words; ``reason`` says why it does not apply (empty when it does).
    """

    step: int
    lever: str
    label: str
    applicable: bool
    reason: str = ""
    peak_bytes: Optional[int] = None
    usable_bytes: Optional[int] = None
    breakdown: dict[str, int] = field(default_factory=dict)
    cost: Cost = field(default_factory=Cost)
    constraints: list[Finding] = field(default_factory=list)
    flags: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    peft_note: str = ""
    """Set when the PEFT change is not in ``overrides``: why, and the Python line that makes it."""
    config: Any = field(default=None, repr=False, compare=False)
    """The config this option leads to, as the estimate saw it (not serialised)."""
    saves: dict[str, int] = field(default_factory=dict)
    """For a combined answer: the bytes of peak each of its levers saves (its peak without the lever minus its own)."""

    @property
    def fits(self) -> bool:
        return self.applicable and self.peak_bytes is not None and self.peak_bytes <= self.usable_bytes

    def as_dict(self) -> dict:
        return {"step": self.step, "lever": self.lever, "label": self.label, "applicable": self.applicable,
                "reason": self.reason, "peak_bytes": self.peak_bytes, "usable_bytes": self.usable_bytes, "fits": self.fits,
                "breakdown": self.breakdown, "cost": vars(self.cost), "constraints": [c.to_dict() for c in self.constraints],
                "memory_config": self.flags, "overrides": self.overrides, "peft_note": self.peft_note,
                "saves": self.saves}


def breakdown(est: MemoryEstimate) -> dict[str, int]:
    """Where the peak goes, for tables and plots: weights, gradients and optimizer, each activation
    category, buffers and the largest transient. The values sum to ``est.steady_peak_bytes`` (the steady state:
    ``est.peak_bytes`` is the largest phase, :mod:`..estimate.phases`)."""
    static = [c for c in est.components if c.kind == STATIC]
    parts = {"weights": sum(c.bytes for c in static if c.name.startswith("weights")),
             "gradients and optimizer": sum(c.bytes for c in static if not c.name.startswith("weights"))}
    parts.update({f"activations: {c.name}": c.bytes for c in est.components if c.kind == ACTIVATIONS})
    largest = est.largest_transient
    parts.update({"buffers": est.total(BUFFERS), "transient": largest.bytes if largest else 0})
    return parts


@dataclass
class State:
    """The config with the levers applied so far, its estimate, and the flags that got it there."""

    cfg: Any
    est: MemoryEstimate
    flags: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    def copy(self) -> "State":
        return State(self.cfg, self.est, dict(self.flags), list(self.overrides))


def validate(flags, cfg) -> list[Finding]:
    """The findings of ``flags`` (a MemoryConfig) on ``cfg``, errors included instead of raised."""
    try:
        return flags.validate(cfg)
    except Refused as refused:
        return refused.findings


def blocking(findings: list[Finding]) -> Optional[str]:
    """The first finding that rules an option out (an error, or no effect), as text; None when none does."""
    for f in findings:
        if f.level in (ERROR, NO_EFFECT):
            return f.text()
    return None


def model_errors(cfg) -> list[Finding]:
    """The model-level refusals ``MemoryConfig.validate`` makes (offloading, recompute, CUDA graphs)."""
    from megatron_bridge_ext.config import MemoryConfig

    return [f for f in validate(MemoryConfig(expandable_segments=False), cfg) if f.level == ERROR]
