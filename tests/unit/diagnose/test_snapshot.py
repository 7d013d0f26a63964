"""The snapshot reader: every figure and verdict derived from the blocks each test builds (tests/support/snapshots.py),
written with pickle.dump (and gzip) and read back through read_snapshot."""

from __future__ import annotations

import gzip
import io
import json
import pickle

import pytest

from megatron_bridge_ext.diagnose.snapshot import RECORDED_MAX_ENTRIES, TOP_GROUPS, is_pickle, rank_from_name, read_snapshot
from tests.support import snapshots as S
from tests.support.snapshots import GiB, MiB

pytestmark = pytest.mark.unit

ATTENTION = S.frame("/usr/lib/python3/site-packages/megatron/core/transformer/attention.py", 412, "forward")
BRIDGE = S.frame("/opt/Megatron-Bridge/src/megatron/bridge/training/train.py", 300, "train_step")
TE = S.frame("/usr/local/lib/python3.12/dist-packages/transformer_engine/pytorch/module/linear.py", 95, "forward")
TORCH = S.frame("/usr/lib/python3/site-packages/torch/nn/functional.py", 2000, "linear")

# The segment of the brief: 2 GiB, 512 MiB live between a 1 GiB and a 512 MiB free block (free blocks are
# never adjacent: the allocator merges them).
BLOCKS = [(GiB, "inactive"), (512 * MiB, "active_allocated"), (512 * MiB, "inactive")]


def _free(blocks):
    return [size for size, state in blocks if state == "inactive"]


def _read(data, name="oom_rank3.snapshot.pickle"):
    return read_snapshot(io.BytesIO(pickle.dumps(data)), name)


def _one(data, name="oom_rank3.snapshot.pickle"):
    (device,) = _read(data, name).devices
    return device


def _brief_segment(device=0):
    return S.segment([S.block(size, state) for size, state in BLOCKS], device=device)


def _rounded(n):
    """The allocator's request rounding (CUDACachingAllocator.cpp round_size: multiples of 512 bytes)."""
    return -(-n // 512) * 512


# ------------------------------------------------------------------------------------------------
# Figures from the blocks
# ------------------------------------------------------------------------------------------------


def test_the_brief_segments_figures_come_from_its_blocks():
    device = _one(S.snapshot([_brief_segment()], {0: [S.oom(_rounded(int(1.2 * GiB)), 0)]}))
    assert device.reserved_bytes == sum(size for size, _ in BLOCKS)
    assert device.allocated_bytes == sum(size for size, state in BLOCKS if state == "active_allocated")
    assert device.free_bytes == sum(_free(BLOCKS)) == 1536 * MiB
    assert device.largest_free_block_bytes == max(_free(BLOCKS)) == GiB
    assert device.inactive_split_bytes == sum(_free(BLOCKS))  # all in a segment of three blocks
    assert (device.segment_count, device.private_pool_bytes, device.active_awaiting_free_bytes) == (1, 0, 0)


def test_a_whole_free_segment_is_free_but_not_split():
    whole = S.segment([S.block(256 * MiB, "inactive")])
    device = _one(S.snapshot([_brief_segment(), whole]))
    assert device.free_bytes == sum(_free(BLOCKS)) + 256 * MiB
    assert device.inactive_split_bytes == sum(_free(BLOCKS))


@pytest.mark.parametrize("state", ["active_pending_free", "active_awaiting_free"])
def test_both_names_of_the_awaiting_free_state_are_one_state(state):
    seg = S.segment([S.block(64 * MiB), S.block(32 * MiB, state), S.block(16 * MiB, "inactive")])
    device = _one(S.snapshot([seg]))
    assert device.active_awaiting_free_bytes == 32 * MiB
    assert (device.allocated_bytes, device.free_bytes) == (64 * MiB, 16 * MiB)


# ------------------------------------------------------------------------------------------------
# Verdicts: (blocks, private segments, request, device_free) -> kind, fragmentation
# ------------------------------------------------------------------------------------------------

PRIVATE_FULL = [(GiB, "active_allocated")]
PRIVATE_PART = [(768 * MiB, "active_allocated"), (256 * MiB, "inactive")]

VERDICTS = [
    # request fits the summed free memory (1.5 GiB) but no single block (1 GiB)
    ("fragmentation-shown", [], int(1.2 * GiB), 0, "fragmentation", "shown"),
    # device_free counts in the sum: 1.8 GiB <= 1.5 GiB + 0.5 GiB, larger than any block
    ("device-free-in-the-sum", [], int(1.8 * GiB), 512 * MiB, "fragmentation", "shown"),
    # larger than all free memory
    ("ruled-out", [], 3 * GiB, 0, "capacity", "ruled out"),
    # a single block would have held it: not decided from the blocks
    ("a-block-fits", [], 900 * MiB, 0, "unknown", "undecided"),
    # the device had room, so a memory-fraction limit refused the segment; it fits in segments' free memory
    ("limit-fits-in-segments", [], int(1.2 * GiB), 10 * GiB, "fragmentation", "shown"),
    ("limit-not-in-segments", [], int(1.8 * GiB), 10 * GiB, "unknown", "undecided"),
    # private pools hold allocated memory that would place it
    ("graph-pools-hold-it", PRIVATE_FULL, int(2.4 * GiB), 0, "cuda-graph pools", "ruled out"),
    ("too-big-even-without-pools", PRIVATE_FULL, 3 * GiB, 0, "capacity", "ruled out"),
    # it fits only counting the free blocks inside a private pool, which the default pool cannot use
    ("only-in-pool-free-blocks", PRIVATE_PART, int(1.6 * GiB), 0, "cuda-graph pools", "ruled out"),
]


@pytest.mark.parametrize("private, asked, device_free, kind, fragmentation",
                         [case[1:] for case in VERDICTS], ids=[case[0] for case in VERDICTS])
def test_verdicts(private, asked, device_free, kind, fragmentation):
    request = _rounded(asked)
    segments = [_brief_segment()]
    if private:
        segments.append(S.segment([S.block(size, state) for size, state in private], pool_id=(1, 0)))
    device = _one(S.snapshot(segments, {0: [S.alloc(512 * MiB), S.oom(request, device_free)]}))
    assert (device.verdict.kind, device.verdict.fragmentation) == (kind, fragmentation), device.verdict.reason
    numbers = device.verdict.numbers
    assert numbers["request_bytes"] == request and numbers["device_free_bytes"] == device_free
    assert numbers["largest_free_block_bytes"] == max(_free(BLOCKS) + _free(private))
    assert numbers["free_in_segments_bytes"] == sum(_free(BLOCKS))
    assert numbers["private_pool_free_bytes"] == sum(_free(private))
    assert device.private_pool_bytes == sum(size for size, _ in private)


# Every boundary of the verdict, on each side and on it (requests move by the allocator's 512-byte step): the brief
# segment has 1.5 GiB free in segments, the largest free block 1 GiB.
FREE, LARGEST, STEP = 1536 * MiB, GiB, 512
HELD = 1024 * MiB  # PRIVATE_FULL: allocated inside a private pool
POOL_FREE = 256 * MiB  # PRIVATE_PART: free inside a private pool

BOUNDARIES = [
    # (case, private, request, device_free, kind, fragmentation, the rule's words)
    ("largest-block-below", [], LARGEST - STEP, 0, "unknown", "undecided", "would hold"),
    ("largest-block-at", [], LARGEST, 0, "unknown", "undecided", "would hold"),
    ("largest-block-above", [], LARGEST + STEP, 0, "fragmentation", "shown", "in no single free block"),
    ("all-free-below", [], FREE - STEP, 0, "fragmentation", "shown", "in no single free block"),
    ("all-free-at", [], FREE, 0, "fragmentation", "shown", "in no single free block"),
    ("all-free-above", [], FREE + STEP, 0, "capacity", "ruled out", "larger than all free memory"),
    ("pool-held-below", PRIVATE_FULL, FREE + HELD - STEP, 0, "cuda-graph pools", "ruled out", "enough to place it"),
    ("pool-held-at", PRIVATE_FULL, FREE + HELD, 0, "cuda-graph pools", "ruled out", "enough to place it"),
    ("pool-held-above", PRIVATE_FULL, FREE + HELD + STEP, 0, "capacity", "ruled out", "larger than all free memory"),
    ("pool-free-below", PRIVATE_PART, FREE - STEP, 0, "fragmentation", "shown", "in no single free block"),
    ("pool-free-at", PRIVATE_PART, FREE, 0, "fragmentation", "shown", "in no single free block"),
    ("pool-free-above", PRIVATE_PART, FREE + STEP, 0, "cuda-graph pools", "ruled out",
     "fits only counting the 256.0 MiB free inside private pools"),
    ("limit-device-free-below", [], LARGEST + STEP, LARGEST, "fragmentation", "shown", "device free) but in no"),
    ("limit-device-free-at", [], LARGEST + STEP, LARGEST + STEP, "fragmentation", "shown", "memory fraction limit"),
    ("limit-in-segments-at", [], FREE, 10 * GiB, "fragmentation", "shown", "memory fraction limit"),
    ("limit-in-segments-above", [], FREE + STEP, 10 * GiB, "unknown", "undecided", "raise the limit"),
]


@pytest.mark.parametrize("private, asked, device_free, kind, fragmentation, words",
                         [case[1:] for case in BOUNDARIES], ids=[case[0] for case in BOUNDARIES])
def test_each_verdict_boundary_below_at_and_above(private, asked, device_free, kind, fragmentation, words):
    segments = [_brief_segment()]
    if private:
        segments.append(S.segment([S.block(size, state) for size, state in private], pool_id=(1, 0)))
    device = _one(S.snapshot(segments, {0: [S.alloc(512 * MiB), S.oom(asked, device_free)]}))
    assert (device.verdict.kind, device.verdict.fragmentation) == (kind, fragmentation), device.verdict.reason
    assert words in device.verdict.reason, device.verdict.reason


def test_without_an_oom_entry_it_says_what_fits_and_why_it_cannot_decide():
    device = _one(S.snapshot([_brief_segment()], {0: [S.alloc(512 * MiB)]}))
    assert (device.verdict.kind, device.verdict.fragmentation, device.oom) == ("unknown", "undecided", None)
    assert "not taken at an out-of-memory error" in device.verdict.reason
    assert device.verdict.numbers == {"largest_free_block_bytes": GiB, "free_in_segments_bytes": sum(_free(BLOCKS))}
    untraced = _one(S.snapshot([_brief_segment()]))
    assert untraced.ring_buffer is None and "memory history was not recorded" in untraced.verdict.reason


def test_the_last_oom_entry_is_the_one_judged():
    trace = [S.oom(_rounded(3 * GiB), 0), S.alloc(MiB), S.oom(_rounded(int(1.2 * GiB)), 0)]
    device = _one(S.snapshot([_brief_segment()], {0: trace}))
    assert device.oom_count == 2 and device.oom.request_bytes == _rounded(int(1.2 * GiB))
    assert device.verdict.kind == "fragmentation"


def test_two_devices_are_summarised_apart():
    big = S.segment([S.block(3 * GiB)], device=0)
    data = S.snapshot([big, _brief_segment(device=1)], {1: [S.oom(_rounded(int(1.2 * GiB)), 0)]})
    zero, one = _read(data).devices
    assert (zero.device, zero.reserved_bytes, zero.free_bytes, zero.verdict.kind) == (0, 3 * GiB, 0, "unknown")
    assert (one.device, one.reserved_bytes, one.verdict.kind) == (1, sum(s for s, _ in BLOCKS), "fragmentation")


def test_a_device_with_a_trace_but_no_segments_is_listed():
    data = S.snapshot([], {0: [S.alloc(MiB)], 1: [S.oom(MiB, 0)]})
    devices = _read(data).devices
    assert [d.device for d in devices] == [0, 1]
    assert devices[1].verdict.kind == "capacity"  # nothing free anywhere


# ------------------------------------------------------------------------------------------------
# Settings, ring buffer, allocation sites
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings, segment_flags, expected", [
    (S.allocator_settings(True), [False], True),
    (S.allocator_settings(False), [False], False),
    (None, [True, False], True),
    (None, [False, False], False),
], ids=["settings-on", "settings-off", "an-expandable-segment", "no-expandable-segment"])
def test_expandable_segments(settings, segment_flags, expected):
    segments = [S.segment([S.block(MiB)], is_expandable=flag) for flag in segment_flags]
    device = _one(S.snapshot(segments, settings=settings))
    assert device.expandable_segments is expected


def test_expandable_segments_unknown_when_nothing_records_them():
    seg = S.segment([S.block(MiB)])
    del seg["is_expandable"]
    assert _one(S.snapshot([seg])).expandable_segments is None


@pytest.mark.parametrize("entries, full", [
    (RECORDED_MAX_ENTRIES, True), (RECORDED_MAX_ENTRIES - 1, False), (RECORDED_MAX_ENTRIES + 1, None), (1, False),
])
def test_ring_buffer_full_when_the_trace_has_the_recorded_limit(entries, full):
    device = _one(S.snapshot([_brief_segment()], {0: [S.alloc(MiB)] * entries}))
    assert (device.ring_buffer.entries, device.ring_buffer.full) == (entries, full)


def test_live_allocations_grouped_by_their_innermost_megatron_bridge_or_te_frame():
    live = [
        (300 * MiB, [TORCH, ATTENTION, BRIDGE]),  # innermost Megatron frame: attention.py
        (200 * MiB, [TORCH, ATTENTION, BRIDGE]),
        (400 * MiB, [TORCH, TE, ATTENTION]),  # TE is innermost
        (100 * MiB, [TORCH, BRIDGE]),
        (50 * MiB, [TORCH]),
        (25 * MiB, []),
    ]
    seg = S.segment([S.block(size, frames=frames) for size, frames in live] + [S.block(MiB, "inactive", [ATTENTION])])
    groups = {g.site: (g.function, g.bytes, g.count) for g in _one(S.snapshot([seg])).top_allocations}
    assert groups == {
        "megatron/core/transformer/attention.py:412": ("forward", 500 * MiB, 2),
        "transformer_engine/pytorch/module/linear.py:95": ("forward", 400 * MiB, 1),
        "megatron/bridge/training/train.py:300": ("train_step", 100 * MiB, 1),
        "[no Megatron, Bridge or TE frame]": ("", 50 * MiB, 1),
        "[no stack recorded]": ("", 25 * MiB, 1),
    }


def test_allocation_groups_are_the_largest_first_and_capped():
    sites = [S.frame(f"/x/megatron/core/m{i}.py", i) for i in range(TOP_GROUPS + 3)]
    seg = S.segment([S.block((i + 1) * MiB, frames=[f]) for i, f in enumerate(sites)])
    groups = _one(S.snapshot([seg])).top_allocations
    assert [g.bytes for g in groups] == [(len(sites) - i) * MiB for i in range(TOP_GROUPS)]


# ------------------------------------------------------------------------------------------------
# Reading: files, gzip, names, bad input
# ------------------------------------------------------------------------------------------------


def test_a_dumped_and_a_gzipped_snapshot_read_back_alike(tmp_path):
    data = S.snapshot([_brief_segment()], {0: [S.oom(_rounded(int(1.2 * GiB)), 0)]}, S.allocator_settings(False))
    plain = S.dump(data, tmp_path / "snapshot_oom_rank-5.pickle")
    packed = S.dump(data, tmp_path / "snapshot_oom_rank-5.pickle.gz", compress=True)
    with open(plain, "rb") as f:
        one = read_snapshot(f, plain)
    with gzip.open(packed, "rb") as f:
        two = read_snapshot(f, packed)
    assert one.rank == two.rank == 5
    assert one.devices == two.devices and one.devices[0].verdict.kind == "fragmentation"


def test_memory_snapshot_list_of_segments_is_read_without_traces():
    device = _one([_brief_segment()])
    assert device.free_bytes == sum(_free(BLOCKS)) and device.ring_buffer is None


def test_lines_headline_per_device_then_evidence_with_units():
    data = S.snapshot([_brief_segment(), _brief_segment(device=1)], {0: [S.oom(_rounded(int(1.2 * GiB)), 0)]})
    lines = _read(data).lines()
    headlines = [line for line in lines if not line.startswith("  ")]
    assert headlines[0].startswith("snapshot rank 3, device 0: fragmentation shown: ")
    assert headlines[1].startswith("snapshot rank 3, device 1: unknown: no oom entry")
    assert "largest is 1.00 GiB" in headlines[0]
    assert any("free in segments 1.50 GiB" in line for line in lines)
    assert len(lines) > len(headlines)


def test_lines_name_the_file_when_the_rank_is_unknown():
    assert _read(S.snapshot([_brief_segment()]), "dump.pickle").lines()[0].startswith("snapshot dump.pickle, device 0: ")


def test_to_dict_is_json_with_bytes_as_ints():
    summary = _read(S.snapshot([_brief_segment()], {0: [S.oom(_rounded(int(1.2 * GiB)), 0)]}))
    data = json.loads(json.dumps(summary.to_dict()))
    device = data["devices"][0]
    assert device["free_bytes"] == sum(_free(BLOCKS)) and isinstance(device["free_bytes"], int)
    assert device["verdict"]["kind"] == "fragmentation" and "segments" not in device
    assert device["oom"] == {"request_bytes": _rounded(int(1.2 * GiB)), "device_free_bytes": 0}


def _with(path, value):
    """A valid snapshot with one field replaced: ``path`` is a list of keys and indices."""
    data = S.snapshot([_brief_segment()], {0: [S.oom(MiB, 0)]}, S.allocator_settings(False))
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


BAD = [
    ("not-a-snapshot", {"stats": {}}, "not a memory snapshot"),
    ("a-plain-int", 7, "not a memory snapshot"),
    ("segments-not-a-list", {"segments": {}, "device_traces": []}, "snapshot.segments is dict"),
    ("total-size-text", _with(["segments", 0, "total_size"], "2GiB"), "segments[0].total_size is str"),
    ("negative-size", _with(["segments", 0, "blocks", 1, "size"], -1), "segments[0].blocks[1].size is -1"),
    ("size-a-bool", _with(["segments", 0, "blocks", 1, "size"], True), "segments[0].blocks[1].size is bool"),
    ("unknown-state", _with(["segments", 0, "blocks", 0, "state"], "free"), "segments[0].blocks[0].state is 'free'"),
    ("pool-id-of-one", _with(["segments", 0, "segment_pool_id"], (0,)), "segment_pool_id is tuple"),
    ("no-device", _with(["segments", 0], {"total_size": 1, "blocks": [], "segment_pool_id": (0, 0)}), "no 'device'"),
    ("trace-not-a-list", _with(["device_traces", 0], "oom"), "device_traces[0] is str"),
    ("oom-without-device-free", _with(["device_traces", 0, 0], {"action": "oom", "size": 1}), "no 'device_free'"),
    ("frame-line-text", _with(["segments", 0, "blocks", 1, "frames"], [{"filename": "a", "line": "x", "name": "f"}]),
     "frames[0].line is str"),
    ("expandable-text", _with(["allocator_settings", "expandable_segments"], "True"),
     "allocator_settings.expandable_segments is str"),
]


@pytest.mark.parametrize("data, expected", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_snapshots_are_one_line_naming_the_file_and_the_field(data, expected):
    with pytest.raises(ValueError) as error:
        _read(data, "rank7.pickle")
    text = str(error.value)
    assert text.startswith("rank7.pickle: ") and "\n" not in text and expected in text, text


@pytest.mark.parametrize("name, rank", [
    ("oom_reports/oom_rank3.snapshot.pickle", 3),  # ours (diagnose/handler.py)
    ("/nemo_run/snapshot_oom_rank-5.pickle", 5),  # Bridge at the OOM
    ("snapshot_oom_rank_6.pickle", 6),  # Megatron-LM's training utils at the OOM
    ("oom_rank-7_snapshot.pickle", 7),  # Megatron-LM's model_provider at the OOM
    ("oom_rank-7_snap_1.pickle", 7),
    ("/nemo_run/snapshot_12.pickle", 12),  # Bridge / Megatron-LM per-rank
    ("snapshot_12.pickle.gz", 12),
    ("snap_1_4", 4),  # a memory_snapshot_path without extension
    ("snapshot.pickle", None),  # Megatron-LM's last-rank dump names no rank
    ("rank3/snapshot.pickle", None),
])
def test_rank_from_name(name, rank):
    assert rank_from_name(name) == rank


@pytest.mark.parametrize("first, expected", [
    (pickle.dumps({}, protocol=2)[:2], True), (pickle.dumps({}, protocol=5)[:2], True),
    (b"\x80\x01", False), (b"\x80\x06", False), (b"\x80", False), (b"", False), (b"{\"", False), (b"\x1f\x8b", False),
])
def test_is_pickle(first, expected):
    assert is_pickle(first) is expected
