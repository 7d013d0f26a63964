"""The walk's pruning of optimizer CPU offload: offloaded only where the same candidate without it does not fit."""

from __future__ import annotations

import types

import pytest

from megatron_bridge_ext.search import candidates as cands
from megatron_bridge_ext.search.walk import _offload_unneeded

pytestmark = [pytest.mark.unit]


def _c(share=None):
    return cands.Candidate(tp=2, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=4, sp=True, micro_batch=1, recompute=(),
                           distributed_optimizer=True, optimizer_offload=share, optimizer_overlap=share is not None)


@pytest.mark.parametrize("twin_fits, expected", [(True, True), (False, False)])
def test_an_offloaded_candidate_is_skipped_when_its_twin_fits(twin_fits, expected):
    done = {_c(): types.SimpleNamespace(fits=twin_fits)}
    assert _offload_unneeded(_c(0.5), done, set(), given=None) is expected


def test_an_offloaded_candidate_is_skipped_when_its_twin_was_dominated_and_kept_when_it_was_refused():
    assert _offload_unneeded(_c(1.0), {}, {_c()}, given=None)
    assert not _offload_unneeded(_c(1.0), {_c(): None}, set(), given=None)


def test_neither_a_candidate_without_the_offload_nor_the_config_as_given_is_skipped():
    fitting = {_c(): types.SimpleNamespace(fits=True)}
    assert not _offload_unneeded(_c(), fitting, set(), given=None)
    assert not _offload_unneeded(_c(0.5), fitting, set(), given=_c(0.5))
