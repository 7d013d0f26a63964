"""The answer's rule on hand-built candidates and figures (no estimate): the fastest that fits, fewer levers at a tie,
and no lever whose removal leaves the peak where it is."""

from dataclasses import dataclass, replace

from megatron_bridge_ext.search.candidates import FULL, Candidate
from megatron_bridge_ext.search import rule

GIVEN = Candidate(tp=4, pp=2, vpp=None, cp=1, ep=1, etp=4, dp=4, sp=True, micro_batch=1, recompute=(),
                  distributed_optimizer=True)
PP4 = replace(GIVEN, pp=4, dp=2)
GiB = 2**30


@dataclass
class Point:
    candidate: Candidate
    peak_bytes: int
    step_time_s: float
    fits: bool


def test_fastest_is_the_least_step_time_among_those_that_fit():
    slow = Point(replace(GIVEN, recompute=("mlp",)), 70 * GiB, 2.6, True)
    quick = Point(PP4, 72 * GiB, 2.2, True)
    quicker_unfit = Point(GIVEN, 95 * GiB, 2.0, False)
    assert rule.fastest([slow, quick, quicker_unfit], GIVEN) is quick


def test_fastest_at_equal_time_takes_the_smaller_peak_then_fewer_levers():
    one = Point(replace(GIVEN, recompute=("mlp",)), 70 * GiB, 2.5, True)
    two_same_peak = Point(replace(GIVEN, recompute=("mlp", "layernorm")), 70 * GiB, 2.5, True)
    assert rule.fastest([two_same_peak, one], GIVEN) is one
    lower = Point(replace(GIVEN, recompute=("mlp", "core_attn")), 69 * GiB, 2.5, True)
    assert rule.fastest([two_same_peak, one, lower], GIVEN) is lower


def test_fastest_is_none_when_nothing_fits():
    assert rule.fastest([Point(GIVEN, 95 * GiB, 2.0, False)], GIVEN) is None


def test_walk_order_puts_fewer_levers_first_at_equal_predicted_time():
    extra = replace(PP4, recompute=("layernorm",))
    order = rule.walk_order([extra, PP4, GIVEN], {extra: 2.2, PP4: 2.2, GIVEN: 2.0}, GIVEN)
    assert order == [GIVEN, PP4, extra]


def test_lever_count_counts_fields_and_recompute_modules():
    c = replace(GIVEN, tp=8, dp=2, sp=True, micro_batch=1, recompute=("mlp", "core_attn"))
    # TP and DP move together: DP is not a lever of its own; two recompute modules are two levers
    assert rule.lever_count(GIVEN, c) == 1 + 2
    assert rule.lever_count(GIVEN, replace(GIVEN, recompute=FULL)) == 1


def test_reverts_take_one_lever_back_each_on_the_same_gpus():
    c = replace(PP4, recompute=("mlp",), micro_batch=1)
    backs = rule.reverts(GIVEN, c)
    assert replace(GIVEN, recompute=("mlp",)) in backs  # PP back to 2: DP back to 4, 32 GPUs kept
    assert PP4 in backs
    assert all(b.tp * b.pp * b.cp * b.dp == 32 for b in backs)
    assert rule.reverts(GIVEN, replace(GIVEN, recompute=FULL)) == [GIVEN]


def test_drop_idle_takes_back_a_recompute_module_that_saves_nothing():
    """The answer PP 2 -> 4 with layernorm recompute: without layernorm the peak is the same, so it goes."""
    answer = Point(replace(PP4, recompute=("layernorm",)), 60 * GiB, 2.3, True)
    figures = {PP4: Point(PP4, 60 * GiB, 2.2, True), replace(GIVEN, recompute=("layernorm",)):
               Point(replace(GIVEN, recompute=("layernorm",)), 95 * GiB, 2.0, False),
               GIVEN: Point(GIVEN, 95 * GiB, 2.0, False)}
    kept, saves = rule.drop_idle(answer, GIVEN, figures.get)
    assert kept.candidate == PP4
    assert saves == {"PP 2->4": (95 - 60) * GiB}


def test_drop_idle_keeps_every_lever_that_lowers_the_peak():
    c = replace(PP4, recompute=("mlp",))
    answer = Point(c, 58 * GiB, 2.5, True)
    figures = {PP4: Point(PP4, 72 * GiB, 2.2, False), replace(GIVEN, recompute=("mlp",)):
               Point(replace(GIVEN, recompute=("mlp",)), 82 * GiB, 2.3, False)}
    kept, saves = rule.drop_idle(answer, GIVEN, figures.get)
    assert kept is answer
    assert saves == {"PP 2->4": (82 - 58) * GiB, "recompute mlp": (72 - 58) * GiB}


def test_the_optimizer_offload_is_one_lever_taken_back_with_its_overlap():
    from megatron_bridge_ext.search.candidates import Candidate
    from megatron_bridge_ext.search.rule import describe_revert, lever_count, reverts

    given = Candidate(tp=2, pp=1, vpp=None, cp=1, ep=1, etp=2, dp=4, sp=True, micro_batch=1, recompute=(),
                      distributed_optimizer=True)
    offloaded = replace(given, optimizer_offload=0.5, optimizer_overlap=True)
    assert lever_count(given, offloaded) == 1
    assert reverts(given, offloaded) == [given]
    assert describe_revert(offloaded, given) == "optimizer offload off->0.5"
