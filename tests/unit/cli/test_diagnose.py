"""`mbx diagnose` as a user runs it: standard input, JSON, the picture, bad options and inputs (CPU only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_bridge_ext.cli import main
from tests.support.cli import ROOT, _one_clean_line, mbx
from tests.unit.diagnose.test_collect import DP, FAILING, _run_lines, _write

pytestmark = pytest.mark.unit


def test_a_log_on_standard_input_with_json(tmp_path):
    log = "\n".join(_run_lines()) + "\n"
    done = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.cli", "diagnose", "-", "--dp", str(DP), "--json"],
                          input=log, text=True, capture_output=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [f["rank"] for f in data["failures"]] == [FAILING]
    assert data["failures"][0]["kind"] == "fragmentation"
    assert data["layout"]["dp"] == DP and data["peak"]["rank"] == 5
    assert data["unit"] == "bytes"


def test_the_picture_has_a_bar_pair_per_reporting_rank_and_readable_labels(tmp_path, capsys):
    png = tmp_path / "ranks.png"
    assert main(["diagnose", _write(tmp_path / "t.log", _run_lines()), "--dp", str(DP), "--plot", str(png)]) == 0
    from matplotlib import image

    height, width = image.imread(str(png)).shape[:2]
    assert width >= 600 and height >= 500
    import matplotlib.pyplot as plt

    from megatron_bridge_ext.diagnose import plot
    from megatron_bridge_ext.diagnose.collect import diagnose_inputs

    figures = []
    monkey = plt.close
    plt.close = lambda fig=None: figures.append(fig)
    try:
        plot.draw(diagnose_inputs([str(tmp_path / "t.log")], sizes={"dp": DP}), str(tmp_path / "again.png"))
    finally:
        plt.close = monkey
    ax = figures[0].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "4", "5"]  # stage 0 then stage 1
    assert [len(c) for c in ax.containers] == [4, 4]  # max reserved and max allocated, one bar per rank
    renderer = figures[0].canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
    assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert "max allocated" in ax.get_title() and "GiB" in ax.get_ylabel()


def test_a_plot_path_that_cannot_be_written_is_refused_before_reading(tmp_path):
    line = _one_clean_line(mbx("diagnose", str(tmp_path / "missing.log"), "--plot", "/nonexistent/dir/x.png"),
                           "--plot", "does not exist")
    assert "missing.log" not in line


@pytest.mark.parametrize("args, fragment", [
    (["--total-memory", "80TB"], "more than any GPU holds"),
    (["--total-memory", "80"], "has no unit"),
    (["--tp", "0"], "--tp 0"),
])
def test_bad_options_are_one_line(tmp_path, args, fragment):
    _one_clean_line(mbx("diagnose", _write(tmp_path / "t.log", _run_lines()), *args), fragment)


def test_a_missing_file_is_named_without_errno(tmp_path):
    line = _one_clean_line(mbx("diagnose", str(tmp_path / "nope.json")), "nope.json", "no such file")
    assert "Errno" not in line


def test_a_code_running_pickle_is_refused_and_runs_nothing(tmp_path):
    import os
    import pickle

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [Evil()], "device_traces": []}))
    done = mbx("diagnose", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr and str(path) in done.stderr
    assert not marker.exists()


def test_a_snapshot_alone_prints_its_verdict_and_draws_its_segment_map(tmp_path, capsys):
    snapshot = ROOT / "tests" / "data" / "diagnose" / "oom_rank0.snapshot.pickle"
    png = tmp_path / "map.png"
    assert main(["diagnose", str(snapshot), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("snapshot rank 0, device 0: fragmentation shown: the 64.0 MiB request")
    assert png.stat().st_size > 0


def test_the_large_input_benchmark_runs_on_small_inputs(tmp_path):
    done = subprocess.run([sys.executable, "scripts/diagnose_stream_bench.py", "--size-gb", "0.001", "--ranks", "16",
                           "--keep", str(tmp_path / "bench")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("16 rank logs") and lines[1].endswith("exit 0")
    assert lines[2].startswith("one merged log of 0.00 GB") and lines[2].endswith("exit 0")


PLAN = ["--hf-config", str(ROOT / "tests" / "data" / "llama-3-8b" / "config.json"), "--tp", "2", "--dp", "2",
        "--seq", "4096", "--peft", "lora", "model.num_layers=2", "logger.log_interval=1"]


def _reports_log(tmp_path):
    """Bridge's reports after iterations 1 and 2 on the DP-rank-0 ranks 0 and 1 of TP 2 x DP 2."""
    from tests.support.oom_logs import bridge_memory_line, bridge_stats, prefixed

    gb = 10**9
    lines = [prefixed(r, bridge_memory_line(r, it, bridge_stats(3 * gb, (4 + it) * gb + r * 10**8, 6 * gb, 7 * gb)))
             for it in (1, 2) for r in (0, 1)]
    return _write(tmp_path / "train.log", lines)


def test_plan_sets_each_report_beside_the_estimate_of_its_phase(tmp_path, capsys):
    from megatron_bridge_ext.cli import build_parser, plan
    from megatron_bridge_ext.estimate.memory import estimate
    from megatron_bridge_ext.estimate.phases import predicted_reports

    assert main(["diagnose", _reports_log(tmp_path), "--json", "--plan", *PLAN]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["world"] == 4 and data["layout"]["sources"]["tp"] == "--plan's config"
    built, options = plan.build_config(build_parser().parse_args(["plan", *PLAN, "--gpu-memory", "80GiB"]))
    predicted = {(p.iteration, p.stage): p for p in predicted_reports(estimate(built.cfg, **options))}
    rows = data["estimate_beside_log"]
    assert [(r["rank"], r["iteration"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for row in rows:
        p = predicted[(row["iteration"], 0)]
        measured = (4 + row["iteration"]) * 10**9 + row["rank"] * 10**8  # the log's figure, exact in 5 digits
        assert row["phase"] == p.phase and row["predicted_max_allocated_bytes"] == p.max_allocated_bytes
        assert row["gap_bytes"] == measured - p.max_allocated_bytes
        assert row["reserved_minus_allocated_bytes"] == 7 * 10**9 - measured
    assert rows[0]["phase"] != rows[1]["phase"]  # iteration 1's report is not the steady state's


def test_plan_predicts_the_iterations_the_log_reports_without_a_log_interval_given(tmp_path, capsys):
    """The recipe's own logger.log_interval (not 1) would print no report after iterations 1 and 2; each report line
    says after which iteration it was taken, and that is the iteration predicted."""
    without_interval = [w for w in PLAN if not w.startswith("logger.log_interval")]
    assert main(["diagnose", _reports_log(tmp_path), "--json", "--plan", *without_interval]) == 0
    rows = json.loads(capsys.readouterr().out)["estimate_beside_log"]
    assert [(r["iteration"], r["phase"] is not None) for r in rows] == [(1, True), (2, True), (1, True), (2, True)]
    assert rows[1]["phase"] == "steady state"


def test_plan_sets_a_snapshots_private_pools_beside_the_capture_phases_pool(tmp_path, capsys):
    """With per-layer TE graphs captured after one warmup iteration, rank 0's snapshot (3 GiB live and 1 GiB free in a
    private pool, 4 GiB in the default one) is set beside stage 0's predicted pool, named as the capture phase's."""
    from megatron_bridge_ext.cli import build_parser, plan
    from megatron_bridge_ext.estimate.memory import estimate
    from tests.support import snapshots as snap

    graphs = [*PLAN, "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_warmup_steps=1",
              "model.use_te_rng_tracker=true"]
    gib = 1 << 30
    pool = [snap.block(3 * gib), snap.block(gib, state="inactive")]
    shot = snap.dump(snap.snapshot([snap.segment([snap.block(4 * gib)]), snap.segment(pool, pool_id=(7, 1))]),
                     tmp_path / "oom_rank0.snapshot.pickle")
    assert main(["diagnose", _reports_log(tmp_path), shot, "--json", "--plan", *graphs]) == 0
    [row] = json.loads(capsys.readouterr().out)["graph_pools_beside_estimate"]
    built, options = plan.build_config(build_parser().parse_args(["plan", *graphs, "--gpu-memory", "80GiB"]))
    predicted = estimate(built.cfg, **options).stage_graph_pools[0]
    assert (row["rank"], row["stage"], row["pool_bytes"], row["free_bytes"]) == (0, 0, 4 * gib, gib)
    assert row["predicted_pool_bytes"] == predicted.total_bytes and predicted.static_bytes > 0
    assert row["verdict"].startswith("within" if 4 * gib <= predicted.total_bytes else "beyond")


@pytest.mark.parametrize("extra, plan_words, fragment", [
    ([], ["--tp", "2"], "--plan needs the run's config"),
    (["--tp", "4"], PLAN, "--tp 4 contradicts the config of --plan (tp 2)"),
    ([], [*PLAN, "--tp", "0"], "--plan: "),
])
def test_plan_refusals_are_one_line(tmp_path, extra, plan_words, fragment):
    _one_clean_line(mbx("diagnose", _reports_log(tmp_path), *extra, "--plan", *plan_words), fragment)


def test_plan_with_a_log_without_reports_is_refused_before_the_estimate(tmp_path):
    line = _one_clean_line(mbx("diagnose", _write(tmp_path / "t.log", _run_lines()[-4:]), "--plan", *PLAN),
                           "no memory report line")
    assert "importing Megatron Bridge" not in line
