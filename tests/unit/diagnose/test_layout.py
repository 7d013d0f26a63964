"""Global rank -> coordinates, checked against Megatron Core's own RankGenerator (CPU only)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.diagnose.layout import DEFAULT_ORDER, TP_PP_DP_ORDER, Layout, LayoutError

pytestmark = pytest.mark.unit


def _core_groups(tp, ep, dp, pp, cp, order, token):
    from megatron.core.parallel_state import RankGenerator

    return RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order).get_ranks(token)


def _index_in_group(groups, rank):
    for group in groups:
        if rank in group:
            return group.index(rank)
    raise AssertionError(rank)


@pytest.mark.parametrize("order", [DEFAULT_ORDER, TP_PP_DP_ORDER])
def test_tp2_pp2_dp2_matches_core(order):
    layout = Layout(8, tp=2, pp=2, order=order)
    for rank in range(8):
        c = layout.coordinates(rank)
        for name, value in (("tp", c.tp), ("pp", c.pp), ("dp", c.dp), ("cp", c.cp)):
            assert _index_in_group(_core_groups(2, 1, 2, 2, 1, order, name), rank) == value, (rank, name)


def test_tp4_ep4_dp2_matches_core_for_dense_and_expert_coordinates():
    """World 8 = TP 4 x DP 2; the experts: ETP 1 (Bridge's default with EP > 1) x EP 4 x expert DP 2."""
    layout = Layout(8, tp=4, ep=4)
    assert (layout.expert_tp, layout.expert_dp) == (1, 2)
    for rank in range(8):
        c = layout.coordinates(rank)
        assert _index_in_group(_core_groups(4, 1, 2, 1, 1, DEFAULT_ORDER, "tp"), rank) == c.tp
        assert _index_in_group(_core_groups(4, 1, 2, 1, 1, DEFAULT_ORDER, "dp"), rank) == c.dp
        assert _index_in_group(_core_groups(1, 4, 2, 1, 1, DEFAULT_ORDER, "ep"), rank) == c.ep
        assert _index_in_group(_core_groups(1, 4, 2, 1, 1, DEFAULT_ORDER, "dp"), rank) == c.edp


def test_the_headline_form():
    assert Layout(8, tp=2, pp=2).coordinates(4).text() == "PP stage 1, TP 0, CP 0, DP 0"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(world=6, tp=4), "not divisible by TP x PP x CP"),
    (dict(world=8, tp=2, ep=8, etp=2), "not divisible by ETP x EP x PP"),
    (dict(world=8, tp=0), "whole number >= 1"),
])
def test_impossible_sizes_are_refused(kwargs, fragment):
    with pytest.raises(LayoutError, match=fragment):
        Layout(**kwargs)


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(LayoutError, match="outside the world of 8"):
        Layout(8, tp=2).coordinates(8)


@pytest.mark.parametrize("order", [DEFAULT_ORDER, TP_PP_DP_ORDER])
@pytest.mark.parametrize("world, tp, cp, pp", [(16, 2, 2, 2), (16, 1, 4, 2), (24, 2, 3, 1)])
def test_context_parallel_layouts_match_core(order, world, tp, cp, pp):
    """DP is world / (TP x PP x CP): with CP > 1 every coordinate of every rank is Core's, e.g. world 16, TP 2, CP 2,
    PP 2 puts rank 8 at PP stage 1, DP 0 in the default order (DP 2 and stage 0 if CP were left out of DP)."""
    layout = Layout(world, tp=tp, pp=pp, cp=cp, order=order)
    dp = world // (tp * pp * cp)
    assert layout.dp == dp
    for rank in range(world):
        c = layout.coordinates(rank)
        for name, value in (("tp", c.tp), ("cp", c.cp), ("dp", c.dp), ("pp", c.pp)):
            assert _index_in_group(_core_groups(tp, 1, dp, pp, cp, order, name), rank) == value, (rank, name)


def test_rank_8_of_world_16_tp2_cp2_pp2_is_on_the_second_stage():
    assert Layout(16, tp=2, pp=2, cp=2).coordinates(8).text() == "PP stage 1, TP 0, CP 0, DP 0"


def test_expert_coordinates_with_context_parallelism_match_core():
    """The experts' generator has no CP (Core: RankGenerator(etp, ep, edp, pp, cp=1)): expert DP = world / (ETP x EP
    x PP), while the dense DP divides by CP too."""
    layout = Layout(16, tp=2, cp=2, ep=4, etp=1)
    assert (layout.dp, layout.expert_dp) == (4, 4)
    for rank in range(16):
        c = layout.coordinates(rank)
        assert _index_in_group(_core_groups(2, 1, 4, 1, 2, DEFAULT_ORDER, "cp"), rank) == c.cp
        assert _index_in_group(_core_groups(2, 1, 4, 1, 2, DEFAULT_ORDER, "dp"), rank) == c.dp
        assert _index_in_group(_core_groups(1, 4, 4, 1, 1, DEFAULT_ORDER, "ep"), rank) == c.ep
        assert _index_in_group(_core_groups(1, 4, 4, 1, 1, DEFAULT_ORDER, "dp"), rank) == c.edp
