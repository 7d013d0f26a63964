"""Global rank -> place in the parallel layout, in Megatron Core's rank order.

Megatron Core numbers ranks with ``RankGenerator`` (``megatron/core/parallel_state.py``): given the
sizes and an order string, the first name in the order varies fastest. ``initialize_model_parallel``
builds two generators over the same ranks (Core 0.17-0.19):

* the decoder's, ``RankGenerator(tp, ep=1, dp, pp, cp, order)``: attention and dense layers;
* the experts', ``RankGenerator(etp, ep, edp, pp, cp=1, order)``, where the expert data-parallel size
  is ``world / (etp * ep * pp)``.

The order is ``"tp-cp-ep-dp-pp"`` by default; Bridge passes ``"tp-cp-ep-pp-dp"`` when
``dist.use_tp_pp_dp_mapping`` is set (``megatron/bridge/training/initialize.py``,
``_initialize_distributed``). So with the default order ``rank = tp + TP * (cp + CP * (dp + DP * pp))``,
and for the experts ``rank = etp + ETP * (ep + EP * (edp + EDP * pp))``.

Pure: no torch, no Megatron import; the readers give it sizes, the report asks it for coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"
ORDERS = (DEFAULT_ORDER, TP_PP_DP_ORDER)


class LayoutError(ValueError):
    """Sizes that no Megatron run could have: the message names the sizes and the fix."""


@dataclass(frozen=True)
class Coordinates:
    """One rank's place: decoder coordinates and, with experts, its expert coordinates."""

    rank: int
    pp: int
    tp: int
    cp: int
    dp: int
    ep: Optional[int] = None
    etp: Optional[int] = None
    edp: Optional[int] = None

    def text(self) -> str:
        words = [f"PP stage {self.pp}", f"TP {self.tp}", f"CP {self.cp}", f"DP {self.dp}"]
        if self.ep is not None:
            words += [f"EP {self.ep}", f"ETP {self.etp}", f"expert DP {self.edp}"]
        return ", ".join(words)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Layout:
    """World size and parallel sizes; ``dp`` (and the expert DP) follow from the others."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    order: str = DEFAULT_ORDER
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("world", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} = {value!r}: a parallel size is a whole number >= 1")
        if self.order not in ORDERS:
            raise LayoutError(f"order {self.order!r} is not one of Megatron Core's orders {ORDERS}")
        model = self.tp * self.pp * self.cp
        if self.world % model:
            raise LayoutError(f"world size {self.world} is not divisible by TP x PP x CP = {self.tp} x {self.pp} x "
                              f"{self.cp} = {model}. Fix: give the sizes the run used (--tp/--pp/--cp/--dp)")
        expert = self.expert_tp * self.ep * self.pp
        if self.ep > 1 and self.world % expert:
            raise LayoutError(f"world size {self.world} is not divisible by ETP x EP x PP = {self.expert_tp} x "
                              f"{self.ep} x {self.pp} = {expert}. Fix: give the sizes the run used (--ep/--etp)")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        """The expert TP as set, else as Bridge and Core default it (:func:`default_expert_tp`)."""
        from megatron_bridge_ext.levers.parallelism.constraints import default_expert_tp

        return default_expert_tp(self.tp, self.ep) if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.world // (self.expert_tp * self.ep * self.pp)

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} is outside the world of {self.world} ranks. Fix: give the world size "
                              "the run used (the log's world size, or --tp x --pp x --cp x --dp)")
        dense = _unravel(rank, self.order, {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp})
        if self.ep == 1:
            return Coordinates(rank, dense["pp"], dense["tp"], dense["cp"], dense["dp"])
        expert = _unravel(rank, self.order, {"tp": self.expert_tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp,
                                             "pp": self.pp})
        return Coordinates(rank, dense["pp"], dense["tp"], dense["cp"], dense["dp"],
                           ep=expert["ep"], etp=expert["tp"], edp=expert["dp"])

    def text(self) -> str:
        words = [f"world {self.world}", f"TP {self.tp}", f"PP {self.pp}", f"CP {self.cp}", f"DP {self.dp}"]
        if self.ep > 1:
            words += [f"EP {self.ep}", f"ETP {self.expert_tp}", f"expert DP {self.expert_dp}"]
        return ", ".join(words) + f" (rank order {self.order})"

    def to_dict(self) -> dict:
        out = {"world": self.world, "tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp, "order": self.order}
        if self.ep > 1:
            out.update(ep=self.ep, etp=self.expert_tp, expert_dp=self.expert_dp)
        out["sources"] = dict(self.sources)
        return out


def _unravel(rank: int, order: str, sizes: dict[str, int]) -> dict[str, int]:
    """RankGenerator's numbering: the first name of ``order`` varies fastest."""
    out = {}
    for name in order.split("-"):
        out[name] = rank % sizes[name]
        rank //= sizes[name]
    return out
