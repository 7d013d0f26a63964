"""Assertions that keep the ranks of a functional test in step.

Every rank computes its own verdict, the verdicts are all-reduced (MAX) over a process group,
and every rank asserts on the reduced value: both ranks pass or fail together, so a failure on
one rank never leaves the other waiting in a collective of the next test.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def max_over_ranks(value: float, group) -> float:
    """The largest ``value`` over the ranks of ``group``."""
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.item()


def all_ranks_equal(got: torch.Tensor, want: torch.Tensor, group) -> bool:
    """True when got and want are bitwise equal (same shape, dtype, values) on every rank."""
    return max_over_ranks(0.0 if torch.equal(got, want) else 1.0, group) == 0.0


def local_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max|want| in float64 on this rank (inf when the shapes differ)."""
    if got.shape != want.shape:
        return float("inf")
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def rel_err(got: torch.Tensor, want: torch.Tensor, group) -> float:
    """max|got - want| / max|want| (in float64), the largest over the ranks."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return max_over_ranks(local_rel_err(got, want), group)


def assert_no_problems(problems: Iterable[str], group) -> None:
    """Fail on every rank when any rank found a problem; this rank's problems are the message."""
    problems = list(problems)
    failed = max_over_ranks(1.0 if problems else 0.0, group)
    assert failed == 0.0, f"rank {dist.get_rank()}: " + ("; ".join(problems) or "another rank failed")
