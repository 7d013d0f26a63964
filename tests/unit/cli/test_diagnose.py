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
