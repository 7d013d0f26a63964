"""The OOM classifier: memory stats -> fragmentation or capacity, its thresholds, its evidence and next step (CPU only)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.diagnose import classifier as diagnose, DECISION_ORDER, classify, parse_oom_message
from megatron_bridge_ext.diagnose.classifier import MIN_GAP_BYTES
from tests.support.memstats import GiB, MiB, capacity_stats, fragmentation_stats, memory_stats
from tests.support.diagnose import OOM_MESSAGE

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------------------------
# classify
# --------------------------------------------------------------------------------------------


def test_fragmentation_stats_are_fragmentation_and_the_next_step_is_the_allocator():
    d = classify(fragmentation_stats(), expandable_segments=False, request_bytes=2 * GiB)
    assert d.kind == "fragmentation"
    assert d.headline.startswith("fragmentation: 22.60 GiB reserved but unallocated")
    assert d.next_step["step"] == 1 and d.next_step["name"] == "allocator"
    assert d.row == diagnose.TABLE["fragmentation"]
    gap = d.metrics["reserved_bytes"] - d.metrics["allocated_bytes"]
    assert d.metrics["reserved_unallocated_bytes"] == gap == 22 * GiB + 614 * MiB
    assert any("4 allocation retries" in e for e in d.evidence)
    assert any("(2.00 GiB) is smaller than" in e for e in d.evidence)


def test_fragmentation_with_expandable_segments_on_moves_to_step_two():
    d = classify(fragmentation_stats(), allocator_settings="max_split_size_mb:512,expandable_segments:True")
    assert d.kind == "fragmentation" and d.metrics["expandable_segments"] is True
    assert d.next_step["step"] == 2 and "already on" in d.notes[0]


def test_capacity_stats_are_capacity_and_the_next_step_is_lora_input():
    d = classify(capacity_stats(), total_memory=int(79.19 * GiB), expandable_segments=False)
    assert d.kind == "capacity"
    assert d.headline.startswith("capacity: 76.90 GiB allocated of 79.19 GiB device memory")
    assert d.next_step["step"] == 2 and 'sequence_parallel_input_strategy="shard_local"' in d.next_step["action"]
    assert d.row == diagnose.TABLE["capacity"]
    assert any("do not fix a capacity OOM" in n for n in d.notes)


def test_capacity_notes_memory_outside_the_allocator():
    stats = memory_stats(allocated=50 * GiB, reserved=51 * GiB, inactive_split=200 * MiB)
    d = classify(stats, total_memory=80 * GiB)
    assert d.kind == "capacity" and any("outside PyTorch's allocator" in n for n in d.notes)


def test_thresholds_decide_at_their_documented_boundaries():
    """Documented: gap >= 10% of reserved, or inactive split >= 5% of reserved, and gap >= 256 MiB.

    The boundaries are exact: a value AT the threshold counts (>=), one byte below does not.
    """
    reserved = 40 * GiB  # 10% = 4 GiB, 5% = 2 GiB
    quiet_split = 2 * GiB - 64 * MiB  # below its own threshold, so the gap alone decides
    at = memory_stats(allocated=reserved - 4 * GiB, reserved=reserved, inactive_split=quiet_split)
    below = memory_stats(allocated=reserved - 4 * GiB + 1, reserved=reserved, inactive_split=quiet_split)
    assert (classify(at).kind, classify(below).kind) == ("fragmentation", "capacity")
    gap = 3 * GiB  # below 10%: the inactive split alone decides
    split_at = memory_stats(allocated=reserved - gap, reserved=reserved, inactive_split=2 * GiB)
    split_below = memory_stats(allocated=reserved - gap, reserved=reserved, inactive_split=2 * GiB - 1)
    assert (classify(split_at).kind, classify(split_below).kind) == ("fragmentation", "capacity")
    small = 1 * GiB  # 256 MiB floor: a gap of exactly 256 MiB counts, one byte less does not
    floor_at = memory_stats(allocated=small - 256 * MiB, reserved=small, inactive_split=0)
    floor_below = memory_stats(allocated=small - 256 * MiB + 1, reserved=small, inactive_split=0)
    assert (classify(floor_at).kind, classify(floor_below).kind) == ("fragmentation", "capacity")


def test_a_request_larger_than_all_free_memory_is_capacity_however_split_the_cache():
    """Fragmentation-looking stats, but the failed request exceeds every free byte together (reserved but
    unallocated plus the device's unreserved part): no allocator could have placed it, so it is capacity.
    One byte less fits in principle, and the stats decide again (fragmentation)."""
    stats = fragmentation_stats()
    total = 80 * GiB
    free = (74 * GiB + 614 * MiB - 52 * GiB) + (total - (74 * GiB + 614 * MiB))  # gap + unreserved = 28 GiB
    assert free == 28 * GiB
    over = classify(stats, total_memory=total, request_bytes=free + 1)
    fits = classify(stats, total_memory=total, request_bytes=free)
    assert (over.kind, fits.kind) == ("capacity", "fragmentation")
    assert over.evidence[0].startswith("the failed request (28.00 GiB) is larger than all free memory together "
                                       "(28.00 GiB: reserved but unallocated plus unreserved)")
    # Without the device's total the unreserved part is unknown: the stats alone decide.
    assert classify(stats, request_bytes=free + 1).kind == "fragmentation"


def test_small_gap_is_capacity_even_when_its_fraction_is_high():
    stats = memory_stats(allocated=1 * GiB, reserved=1 * GiB + MIN_GAP_BYTES - 2 * MiB,
                         inactive_split=MIN_GAP_BYTES - 64 * MiB, small_reserved=4 * MiB, small_allocated=2 * MiB)
    assert classify(stats).kind == "capacity"


def test_missing_or_empty_stats_are_an_error_that_says_what_to_pass():
    with pytest.raises(ValueError, match="reserved_bytes.all.current"):
        classify({"allocated_bytes.all.current": 1})
    with pytest.raises(ValueError, match="empty before CUDA is initialised"):
        classify({})
    with pytest.raises(ValueError, match="cudaMallocAsync"):
        classify({"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0})


def test_format_starts_with_the_class_and_lists_the_decision_order():
    text = classify(fragmentation_stats()).format()
    lines = text.splitlines()
    assert lines[0].startswith("fragmentation:")
    steps = [line for line in lines if line.startswith("  ") and line[2:3].isdigit()]
    assert [line[:5] for line in steps[-len(DECISION_ORDER):]] == [f"  {i}. " for i in range(1, len(DECISION_ORDER) + 1)]
    assert steps[-len(DECISION_ORDER)].startswith("  1. allocator")
    assert lines[-1].startswith("source of the figures: Megatron Bridge documentation")
    assert "-28.4%" in text and "-5.9%" in text and "PP = 1" in text


def test_parse_oom_message():
    parsed = parse_oom_message(OOM_MESSAGE)
    assert parsed == {"request_bytes": 2 * GiB, "total_capacity_bytes": int(79.19 * GiB), "free_bytes": int(1.52 * GiB)}
    assert parse_oom_message("something else") == {"request_bytes": None, "total_capacity_bytes": None,
                                                   "free_bytes": None}


def test_a_gb_total_below_reserved_explains_the_gpu_sales_figure():
    """A GPU sold as "80GB" whose allocator reserved 77 GiB: 80 GB (74.5 GiB) is refused with the GiB fix."""
    stats = memory_stats(allocated=76 * GiB, reserved=77 * GiB, inactive_split=300 * MiB)
    with pytest.raises(ValueError) as error:
        classify(stats, total_memory=80 * 10**9)
    message = str(error.value)
    assert message.startswith("--total-memory 80GB is 74.51 GiB (GB = 10^9 bytes), less than the 77.00 GiB reserved")
    assert 'holds about 80 GiB' in message and ". Fix: --total-memory 80GiB" in message
    assert classify(stats, total_memory=80 * GiB).kind == "capacity"


def test_a_gb_total_that_holds_the_reserved_bytes_gets_a_note_not_a_new_reading():
    d = classify(capacity_stats(), total_memory=80 * 10**9 + 40 * 10**9)  # 120GB: no GPU size, still in GB
    assert d.metrics["total_memory"] == 120 * 10**9  # read as written
    assert any(n.startswith("--total-memory 120GB is 111.76 GiB") and "--total-memory 120GiB" in n for n in d.notes)
    assert not any("120GB" in n for n in classify(capacity_stats(), total_memory=120 * GiB).notes)


# --------------------------------------------------------------------------------------------
# Expandable segments unknown, and every threshold on each side and on its boundary
# --------------------------------------------------------------------------------------------


def test_fragmentation_with_expandable_segments_unknown_advises_the_allocator_first():
    """A bare memory_stats() dump says nothing of the allocator's settings: expandable segments may be off, so the
    first lever (turn them on) is the next step, and the evidence says their state is unknown."""
    d = classify(fragmentation_stats())
    assert d.kind == "fragmentation" and d.metrics["expandable_segments"] is None
    assert (d.next_step["step"], d.next_step["name"]) == (1, "allocator")
    assert "expandable segments: unknown" in d.evidence and d.headline.endswith("expandable segments unknown")
    assert not any("already on" in n for n in d.notes)


RESERVED = 40 * GiB  # 10% = 4 GiB, 5% = 2 GiB
QUIET_SPLIT = 2 * GiB - 64 * MiB  # under its own threshold: the gap alone decides
QUIET_GAP = 3 * GiB  # under 10% of reserved: the inactive split alone decides
SMALL = 1 * GiB  # the floor's cases: any gap of 256 MiB is over 10% of it


def _gap_fraction(gap):
    return memory_stats(allocated=RESERVED - gap, reserved=RESERVED, inactive_split=QUIET_SPLIT)


def _split_fraction(split):
    return memory_stats(allocated=RESERVED - QUIET_GAP, reserved=RESERVED, inactive_split=split)


def _floor(gap):
    return memory_stats(allocated=SMALL - gap, reserved=SMALL, inactive_split=0)


THRESHOLDS = [
    # (case, stats, kind, the rule's words in the evidence)
    ("gap-fraction-below", _gap_fraction(4 * GiB - 1), "capacity", "of reserved (fragmentation needs >= 10%"),
    ("gap-fraction-at", _gap_fraction(4 * GiB), "fragmentation", "= 10.0% of reserved (threshold 10%)"),
    ("gap-fraction-above", _gap_fraction(4 * GiB + 1), "fragmentation", "of reserved (threshold 10%)"),
    ("split-fraction-below", _split_fraction(2 * GiB - 1), "capacity", "of reserved (fragmentation needs >= 5%)"),
    ("split-fraction-at", _split_fraction(2 * GiB), "fragmentation", "= 5.0% of reserved (threshold 5%)"),
    ("split-fraction-above", _split_fraction(2 * GiB + 1), "fragmentation", "of reserved (threshold 5%)"),
    ("gap-floor-below", _floor(MIN_GAP_BYTES - 1), "capacity", "and >= 256.0 MiB)"),
    ("gap-floor-at", _floor(MIN_GAP_BYTES), "fragmentation", "reserved - allocated = 256.0 MiB = 25.0% of reserved "
                                                             "(threshold 10%)"),
    ("gap-floor-above", _floor(MIN_GAP_BYTES + 1), "fragmentation", "(threshold 10%)"),
]


@pytest.mark.parametrize("stats, kind, words", [c[1:] for c in THRESHOLDS], ids=[c[0] for c in THRESHOLDS])
def test_each_threshold_below_at_and_above_its_boundary(stats, kind, words):
    d = classify(stats)
    assert d.kind == kind
    assert any(words in e for e in d.evidence), d.evidence


TOTAL = 80 * GiB
FREE = 28 * GiB  # fragmentation_stats on an 80 GiB device: 22.6 GiB reserved but unallocated + 5.4 GiB unreserved


@pytest.mark.parametrize("request_bytes, kind, words", [
    (FREE - 1, "fragmentation", "is larger than the reserved but unallocated memory"),
    (FREE, "fragmentation", "is larger than the reserved but unallocated memory"),
    (FREE + 1, "capacity", "is larger than all free memory together"),
], ids=["below", "at", "above"])
def test_a_request_below_at_and_above_all_free_memory(request_bytes, kind, words):
    """The request is judged against every free byte together (reserved but unallocated plus unreserved): one
    that equals them could be placed by an allocator that did not fragment."""
    d = classify(fragmentation_stats(), total_memory=TOTAL, request_bytes=request_bytes)
    assert d.kind == kind
    assert any(words in e for e in d.evidence), d.evidence


@pytest.mark.parametrize("request_bytes, relation", [
    (22 * GiB + 614 * MiB - 1, "smaller"), (22 * GiB + 614 * MiB, "smaller"), (22 * GiB + 614 * MiB + 1, "larger"),
], ids=["below", "at", "above"])
def test_a_request_against_the_reserved_but_unallocated_memory(request_bytes, relation):
    """Supporting evidence: a request that the cache's free bytes would hold (equal included) is "smaller"."""
    d = classify(fragmentation_stats(), request_bytes=request_bytes)
    assert any(f"is {relation} than the reserved but unallocated memory" in e for e in d.evidence), d.evidence


def test_stats_without_an_oom_say_so_and_show_the_state():
    """A healthy dump (num_ooms 0) is no failure: its class says no OOM is recorded, its headline gives the state,
    and what an OOM at these figures would read as is a note, not a fix."""
    stats = fragmentation_stats()
    stats["num_ooms"] = 0
    d = classify(stats)
    assert d.kind == diagnose.NO_OOM
    assert d.headline.startswith("no out-of-memory error is recorded in these stats (num_ooms 0): they show the state")
    assert "22.60 GiB of it unallocated" in d.headline
    assert d.next_step["step"] is None and "an out-of-memory error at these figures would read as fragmentation" \
        in d.notes
    assert "next step: no out-of-memory error to act on" in d.format()
    assert classify(fragmentation_stats()).kind == "fragmentation"  # num_ooms 1: the same figures are an OOM
