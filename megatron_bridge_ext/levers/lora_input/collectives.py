"""The collectives of each LoRA-A input strategy: one table, read for its words and for its counts.

The strategy registry (:data:`.sp_lora.STRATEGIES`) describes what a strategy communicates from this
table, and the plan's cost (:mod:`.cost`) counts the elements and prints the formula from it, so
the description and the price cannot disagree. Imports nothing (no torch): the strategies' names
live here so that both readers can import them.
"""

from __future__ import annotations

from dataclasses import dataclass

OFF = "off"
"""LoRA-A takes the gathered input, as in Megatron Bridge (the one spelling of "no strategy")."""
REGATHER = "regather"
SHARD_LOCAL = "shard_local"

SIZES = ("s*b*r", "s*b*h", "r*h")
"""The sizes a collective moves, in the order a formula lists them."""


@dataclass(frozen=True)
class Collective:
    """One collective of one eligible LoRA-A adapter per microbatch, counted at its full (gathered) size."""

    op: str
    of: str
    size: str
    phase: str
    input_grad_only: bool = False
    """Issued only when the adapter's input needs a gradient (not the first layer's under a frozen embedding)."""

    def describe(self) -> str:
        when = f"{self.phase}, with an input gradient" if self.input_grad_only else self.phase
        return f"{self.op} of {self.of} ({self.size}, {when})"


_OUTPUT_OVER_RANK = Collective("all-gather", "the rank-r output over the rank dim", "s*b*r", "forward")
_X = Collective("all-gather", "x", "s*b*h", "forward")
_X_GRAD = Collective("reduce-scatter", "x's grad", "s*b*h", "backward", input_grad_only=True)

COLLECTIVES: dict[str, tuple[Collective, ...]] = {
    OFF: (_X, _OUTPUT_OVER_RANK, _X_GRAD),
    REGATHER: (_X, _OUTPUT_OVER_RANK, Collective("all-gather", "x again", "s*b*h", "backward"), _X_GRAD),
    SHARD_LOCAL: (Collective("all-gather", "A", "r*h", "forward"),
                  Collective("all-gather", "the rank-r output along the sequence", "s*b*r", "forward"),
                  Collective("all-gather", "A again", "r*h", "backward", input_grad_only=True),
                  Collective("reduce-scatter", "A's grad", "r*h", "backward")),
}
"""Per strategy, what one eligible adapter communicates per microbatch (LoRA-A trainable)."""


def describe(strategy: str) -> str:
    """The strategy's collectives in words, e.g. for :class:`.sp_lora.Strategy`'s ``communicates``."""
    return "; ".join(c.describe() for c in COLLECTIVES[strategy])


def counts(strategy: str, *, input_needs_grad: bool = True) -> dict[str, int]:
    """How many collectives of each size the strategy issues per adapter and microbatch."""
    out = dict.fromkeys(SIZES, 0)
    for collective in COLLECTIVES[strategy]:
        if input_needs_grad or not collective.input_grad_only:
            out[collective.size] += 1
    return out


def formula(strategy: str, *, input_needs_grad: bool = True) -> str:
    """The elements as a sum of sizes, e.g. ``s*b*r + 3*r*h``."""
    return _sum(counts(strategy, input_needs_grad=input_needs_grad))


def input_grad_formula(strategy: str) -> str:
    """The elements only an input gradient adds, e.g. ``s*b*h``."""
    with_grad, without = counts(strategy), counts(strategy, input_needs_grad=False)
    return _sum({size: with_grad[size] - without[size] for size in SIZES})


def _sum(counts_by_size: dict[str, int]) -> str:
    return " + ".join(size if n == 1 else f"{n}*{size}" for size, n in counts_by_size.items() if n)
