"""`mbx diagnose` over whole runs: merged and per-rank logs, prefixes, gzip, directories, the run view (CPU only).

The logs are written by tests/support/oom_logs.py; the expected ranks, classes and bytes come from what
the test put into them and from the layout's own arithmetic (rank = tp + TP * (cp + CP * (dp + DP * pp))).
"""

from __future__ import annotations

import gzip
import pickle
import random

import pytest

from megatron_bridge_ext.diagnose.collect import InputError, LayoutError, diagnose_inputs
from megatron_bridge_ext.diagnose.classifier import Diagnosis
from megatron_bridge_ext.diagnose.report import RunDiagnosis
from tests.support.oom_logs import (RUN_DP, RUN_FAILING, RUN_PP, RUN_TP, bridge_memory_line, bridge_stats,
                                    run_lines, run_max_allocated)

pytestmark = pytest.mark.unit
GB = 10**9
TP, PP, DP, FAILING = RUN_TP, RUN_PP, RUN_DP, RUN_FAILING  # rank 6: tp 0, dp 1, pp 1 = 0 + 2 * (0 + 1 * (1 + 2 * 1))
_run_lines, _max_allocated = run_lines, run_max_allocated


def _write(path, lines, compress=False):
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return str(path)


@pytest.mark.parametrize("style", ["torch", "torchrun", "slurm", "mpi"])
def test_a_merged_8_rank_log_gives_the_failing_rank_its_place_class_and_step(tmp_path, style):
    result = diagnose_inputs([_write(tmp_path / "train.log", _run_lines(style))], sizes={"dp": DP})
    assert isinstance(result, RunDiagnosis)
    assert len(result.failures) == 1  # the repeated traceback is one failure
    failure = result.failures[0]
    assert failure.rank == FAILING and failure.coordinates == "PP stage 1, TP 0, CP 0, DP 1"
    assert failure.verdict.kind == "fragmentation" and failure.verdict.next_step["step"] == 1
    assert sorted(result.reports) == [0, 1, 4, 5]
    peak_rank, peak = result.peak()
    assert peak_rank == 5 and peak.get("max_allocated") == _max_allocated(5, 2)
    assert result.silent_ranks() == []
    assert [r["max_allocated_rise_bytes"] for r in result.rises()] == [5 * GB] * 4
    stage1 = result.stage_spread()[1]
    assert (stage1["low_rank"], stage1["high_rank"], stage1["spread_bytes"]) == (4, 5, GB)
    text = result.format()
    assert text.splitlines()[0].startswith("rank 6 = PP stage 1, TP 0, CP 0, DP 1: fragmentation:")


def test_ranks_that_should_report_but_printed_nothing_are_listed(tmp_path):
    result = diagnose_inputs([_write(tmp_path / "train.log", _run_lines(reporters=[0, 1, 5]))], sizes={"dp": DP})
    assert result.silent_ranks() == [4]


def test_a_directory_of_per_rank_gzip_logs_reads_each_rank_from_its_file_name(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    lines = _run_lines(layout=True)
    for rank in range(8):
        own = [x.split(": ", 1)[1] for x in lines if x.startswith(f"[rank{rank}]: ")]
        _write(folder / f"rank{rank}.log.gz", own or ["starting"], compress=True)
    result = diagnose_inputs([str(folder)], sizes={"dp": DP})
    assert [f.rank for f in result.failures] == [FAILING]
    assert sorted(result.reports) == [0, 1, 4, 5]


def test_a_thousand_rank_logs_are_read(tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for rank in range(1000):
        line = bridge_memory_line(rank, 1, bridge_stats(GB, 2 * GB + rank * 10**6, 3 * GB, 3 * GB)) if rank % 8 == 0 \
            else "iteration 1"
        _write(folder / f"rank{rank:04d}.log", [line])
    result = diagnose_inputs([str(folder)], sizes={"tp": 8, "pp": 125})  # DP 1: TP rank 0 of each stage reports
    assert len(result.reports) == 125 and result.peak()[0] == 992
    assert result.layout.world == 1000


def test_a_layout_that_puts_reporting_ranks_off_data_parallel_rank_0_is_refused(tmp_path):
    """The log's reports come from ranks 0, 1, 4, 5 (DP rank 0 of TP 2 x DP 2 x PP 2); --dp 4 puts 4 and 5 at DP 2,
    where Bridge prints no report: the layout is not the run's."""
    with pytest.raises(LayoutError, match=r"ranks 4, 5 printed memory reports, which Bridge prints on data-parallel "
                                          r"rank 0 only.*\(rank 4 at DP 2, rank 5 at DP 2\)"):
        diagnose_inputs([_write(tmp_path / "train.log", _run_lines())], sizes={"dp": 4})
    assert diagnose_inputs([_write(tmp_path / "ok.log", _run_lines())], sizes={"dp": 2}).layout.dp == 2


def test_the_layout_may_come_from_the_command_line_only(tmp_path):
    result = diagnose_inputs([_write(tmp_path / "t.log", _run_lines(layout=False))], sizes={"tp": 2, "pp": 2, "dp": 2})
    assert result.failures[0].coordinates == "PP stage 1, TP 0, CP 0, DP 1"


def test_a_layout_that_contradicts_the_log_is_refused(tmp_path):
    with pytest.raises(LayoutError, match="--tp 4 contradicts the log"):
        diagnose_inputs([_write(tmp_path / "t.log", _run_lines())], sizes={"tp": 4})


def test_a_rank_beyond_the_stated_world_is_refused(tmp_path):
    lines = _run_lines(failing=9)
    with pytest.raises(LayoutError, match="rank 9 appears in the inputs, beyond the world of 8"):
        diagnose_inputs([_write(tmp_path / "t.log", lines)], sizes={"dp": DP})


@pytest.mark.parametrize("content, fragment", [
    (b"", "empty"),
    (b"\x00\x01\x02binary", "neither gzip nor a pickle"),
    (b"\xff\xfe\xfa not utf8 at all, long enough to be judged", "not UTF-8 text"),
    (b"hello\nno memory here\n", "no memory report line and no out-of-memory error"),
    (gzip.compress("\n".join(str(random.Random(0).random()) for _ in range(20000)).encode())[:-30],
     "cannot be read to its end"),
])
def test_bad_inputs_are_one_line_naming_the_file(tmp_path, content, fragment):
    path = tmp_path / "bad.log"
    path.write_bytes(content)
    with pytest.raises(InputError, match=fragment) as error:
        diagnose_inputs([str(path)])
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_single_stats_json_keeps_its_own_output(tmp_path):
    from tests.support.memstats import fragmentation_stats
    import json

    path = tmp_path / "stats.json"
    path.write_text(json.dumps(fragmentation_stats()))
    assert isinstance(diagnose_inputs([str(path)]), Diagnosis)


def test_a_pickle_is_handed_to_the_snapshot_reader_not_unpickled_here(tmp_path, monkeypatch):
    seen = []
    import megatron_bridge_ext.diagnose.collect as collect

    monkeypatch.setattr(collect, "_snapshot", lambda source: seen.append(source.name) or _NoSnapshot())
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": []}, protocol=4))
    diagnose_inputs([str(path), _write(tmp_path / "t.log", _run_lines())], sizes={"dp": DP})
    assert seen == [str(path)]


class _NoSnapshot:
    rank = None

    def lines(self):
        return []

    def to_dict(self):
        return {}


def test_the_shipped_example_log_is_the_generators_output():
    """tests/data/diagnose/merged-8-ranks.log (the docs' example) is `python -m tests.support.oom_logs`'s output."""
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "data" / "diagnose" / "merged-8-ranks.log"
    assert shipped.read_text().splitlines() == run_lines()


def test_the_shipped_snapshot_is_the_workloads_geometry():
    """tests/data/diagnose/oom_rank0.snapshot.pickle (the docs' example) is the device check's geometry pickled."""
    from pathlib import Path

    from megatron_bridge_ext.device_check.fragmentation_workload import snapshot_at_the_oom

    shipped = Path(__file__).resolve().parents[2] / "data" / "diagnose" / "oom_rank0.snapshot.pickle"
    assert shipped.read_bytes() == pickle.dumps(snapshot_at_the_oom(), protocol=4)


def test_the_shipped_two_rank_report_log_is_the_builders_output():
    """tests/data/diagnose/llama-3-8b-2-layers-tp2-dp2.log (the docs' --plan example), line by line."""
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "data" / "diagnose" / "llama-3-8b-2-layers-tp2-dp2.log"
    from tests.support.oom_logs import prefixed

    want = [prefixed(r, bridge_memory_line(r, it, bridge_stats(3 * GB, (4 + it) * GB + r * 10**8, 6 * GB, 7 * GB)))
            for it in (1, 2) for r in (0, 1)]
    assert shipped.read_text().splitlines() == want


def test_the_shipped_graph_pool_snapshot_is_the_builders_output():
    """tests/data/diagnose/llama-3-8b-graphs_oom_rank-0.pickle (the docs' CUDA-graph pool example): 4 GiB live in the
    default pool, 1.5 GiB live and 0.5 GiB free in a private one; the builders' addresses aside."""
    from pathlib import Path

    from tests.support import snapshots as snap

    def unplaced(data):
        def drop(record):
            return {k: v for k, v in record.items() if k != "address"}
        return [dict(drop(s), blocks=[drop(b) for b in s["blocks"]]) for s in data["segments"]]

    shipped = Path(__file__).resolve().parents[2] / "data" / "diagnose" / "llama-3-8b-graphs_oom_rank-0.pickle"
    mib = 1 << 20
    pool = [snap.block(1536 * mib), snap.block(512 * mib, state="inactive")]
    built = snap.snapshot([snap.segment([snap.block(4096 * mib)]), snap.segment(pool, pool_id=(7, 1))])
    loaded = pickle.loads(shipped.read_bytes())
    assert unplaced(loaded) == unplaced(built) and loaded["device_traces"] == built["device_traces"]


def test_a_healthy_stats_dump_in_a_run_is_a_note_not_a_failure(tmp_path):
    import json

    from megatron_bridge_ext.diagnose.collect import diagnose_inputs
    from tests.support.memstats import fragmentation_stats

    healthy = fragmentation_stats()
    healthy["num_ooms"] = 0
    (tmp_path / "rank0_stats.json").write_text(json.dumps(healthy))
    (tmp_path / "rank1_stats.json").write_text(json.dumps(fragmentation_stats()))
    run = diagnose_inputs([str(tmp_path)])
    assert [f.rank for f in run.failures] == [1]
    assert any(n.startswith(f"{tmp_path / 'rank0_stats.json'}: no out-of-memory error is recorded") for n in run.notes)


# ------------------------------------------------------------------------------------------------
# Logs and run directories as clusters write them
# ------------------------------------------------------------------------------------------------


def _oom_message():
    from tests.support.oom_logs import GIB, MIB, allocator_oom

    return allocator_oom(2 * GIB, total=80 * GIB, free=100 * MIB, allocated=60 * GIB, reserved=79 * GIB)


def test_a_torchrun_log_dir_with_other_files_beside_names_the_failing_rank_and_its_class(tmp_path):
    """torchrun --log-dir writes <run id>/attempt_0/<local rank>/{stdout,stderr}.log (stdout.log empty when the
    script prints to stderr) and error.json; a TensorBoard event file and the run's config.json sit beside them. The
    files that are no artifact are skipped, counted by reason; the rank comes from the folder (the lines carry none)."""
    from tests.support.oom_logs import traceback

    run = tmp_path / "logs" / "abc123_0" / "attempt_0"
    for local_rank in range(4):
        folder = run / str(local_rank)
        folder.mkdir(parents=True)
        (folder / "stdout.log").write_text("")
        lines = [" iteration 1/ 10 | consumed samples: 8"] + (traceback(_oom_message()) if local_rank == 3 else [])
        _write(folder / "stderr.log", lines)
        (folder / "error.json").write_text('{"message": {"message": "OutOfMemoryError"}}')
    (tmp_path / "logs" / "events.out.tfevents.1733130000.node1").write_bytes(b"\x18\x00\x00\x00\x00\x00\x00\x00\xa3\x7f"
                                                                             b"K\x22\x08\x00\x00\x00\x00")
    (tmp_path / "logs" / "config.json").write_text('{"model": {"num_layers": 2}}')
    result = diagnose_inputs([str(tmp_path / "logs")], sizes={"tp": 2})
    (failure,) = result.failures
    assert failure.rank == 3 and failure.coordinates == "PP stage 0, TP 1, CP 0, DP 1"
    assert failure.verdict.kind == "fragmentation"
    (skipped,) = [n for n in result.notes if n.startswith("skipped ")]
    assert skipped.startswith("skipped 10 file(s) found in the directories")
    assert "4 empty" in skipped and "5 JSON that is neither" in skipped and "1 binary data" in skipped
    assert any("torchrun --log-dir folders" in n for n in result.layout_notes)


@pytest.mark.parametrize("decorate", [
    lambda line: f"2026-12-02T10:00:39.123456789Z {line}",  # kubectl logs --timestamps
    lambda line: f"\x1b[31m{line}\x1b[0m",  # a logger's colour codes
    lambda line: f"2026-12-02T10:00:39.123Z \x1b[1m{line}\x1b[0m",
], ids=["kubectl-timestamps", "ansi-colour", "both"])
def test_timestamps_and_colour_codes_before_a_rank_prefix_keep_the_rank(tmp_path, decorate):
    from tests.support.oom_logs import traceback

    lines = [decorate(f"[rank6]: {line}") for line in traceback(_oom_message())]
    result = diagnose_inputs([_write(tmp_path / "pod.log", lines)], sizes={"tp": 2, "pp": 2, "dp": 2})
    (failure,) = result.failures
    assert failure.rank == 6 and failure.coordinates == "PP stage 1, TP 0, CP 0, DP 1"


def test_a_log_truncated_in_place_starting_with_nul_bytes_is_read(tmp_path):
    """logrotate's copytruncate empties the file while its writer keeps its offset: the next write leaves NUL bytes
    before it, here more than the reader's first peek."""
    from tests.support.oom_logs import traceback

    path = tmp_path / "rank2.log"
    path.write_bytes(b"\x00" * 10000 + ("\n".join(traceback(_oom_message())) + "\n").encode())
    (failure,) = diagnose_inputs([str(path)]).failures
    assert failure.rank == 2 and failure.verdict.kind == "fragmentation"


def test_an_empty_snapshot_is_one_line_saying_why_and_how_to_take_one(tmp_path):
    (tmp_path / "x.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": []}))  # _dump_snapshot, idle
    with pytest.raises(InputError) as error:
        diagnose_inputs([str(tmp_path / "x.pickle")])
    text = str(error.value)
    assert text.startswith(f"{tmp_path / 'x.pickle'}: the snapshot holds no segment and no trace entry")
    assert "_record_memory_history" in text and "\n" not in text


def test_an_oom_report_with_empty_stats_is_diagnosed_from_its_stored_message(tmp_path):
    """OOMHandler stores the exception's message beside the stats; stats that came back empty leave the message's
    figures: 79 GiB reserved, 60 GiB allocated, a 2 GiB request: fragmentation."""
    import json

    report = {"format": 1, "rank": 0, "exception": {"type": "OutOfMemoryError", "message": _oom_message()},
              "request_bytes": 2 * 2**30, "total_memory": 80 * 2**30, "allocator": {"expandable_segments": False},
              "stats": {}}
    (tmp_path / "oom_rank0.json").write_text(json.dumps(report))
    diagnosis = diagnose_inputs([str(tmp_path / "oom_rank0.json")])
    assert isinstance(diagnosis, Diagnosis) and diagnosis.kind == "fragmentation"
    assert diagnosis.metrics["reserved_bytes"] == 79 * 2**30 and diagnosis.metrics["allocated_bytes"] == 60 * 2**30
    assert diagnosis.notes[0].startswith("the report's stats are empty (the allocator reported none)")
