"""The segment-map picture: a PNG of the size the figure asks for, readable labels that do not overlap."""

from __future__ import annotations

import io
import pickle

import pytest

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from megatron_bridge_ext.diagnose.snapshot import read_snapshot  # noqa: E402
from megatron_bridge_ext.diagnose.snapshot_plot import DPI, MAX_SEGMENTS, build_figure, plot_snapshot  # noqa: E402
from tests.support import snapshots as S  # noqa: E402
from tests.support.snapshots import GiB, MiB  # noqa: E402

pytestmark = pytest.mark.unit


def _fragmented(segments: int):
    """``segments`` segments of 2 GiB, each 1 GiB free, 512 MiB live, 512 MiB free; an OOM of 1.2 GiB."""
    segs = [S.segment([S.block(GiB, "inactive"), S.block(512 * MiB), S.block(512 * MiB, "inactive")])
            for _ in range(segments)]
    segs.append(S.segment([S.block(64 * MiB)], pool_id=(1, 0)))
    data = S.snapshot(segs, {0: [S.oom(1288490496, 0)]})
    return read_snapshot(io.BytesIO(pickle.dumps(data)), "snapshot_oom_rank-2.pickle")


def _overlaps(boxes) -> list:
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


@pytest.mark.parametrize("segments", [1, 6, MAX_SEGMENTS + 10])
def test_tick_labels_do_not_overlap(segments):
    figure = build_figure(_fragmented(segments))
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    (axes,) = figure.axes
    for ticks in (axes.get_yticklabels(), axes.get_xticklabels()):
        boxes = [label.get_window_extent(renderer) for label in ticks if label.get_text() and label.get_visible()]
        assert boxes and not _overlaps(boxes), [label.get_text() for label in ticks]
    (legend,) = figure.legends
    texts = [figure._suptitle, axes.xaxis.label, axes.yaxis.label, legend]
    assert not _overlaps([text.get_window_extent(renderer) for text in texts])


def test_title_axes_and_rows_say_what_is_drawn():
    summary = _fragmented(MAX_SEGMENTS + 10)
    figure = build_figure(summary)
    (axes,) = figure.axes
    title = figure._suptitle.get_text()
    assert "snapshot_oom_rank-2.pickle" in title and "rank 2" in title and "device 0" in title
    assert "fragmentation shown" in title and f"the {MAX_SEGMENTS} largest of {MAX_SEGMENTS + 11} segments" in title
    assert axes.get_xlabel() == "offset within the segment (GiB)"
    labels = [label.get_text() for label in axes.get_yticklabels()]
    assert len(labels) == MAX_SEGMENTS + 1 and labels[-1] == "oom request"
    assert labels[0] == "#1: 2.00 GiB"


def test_the_png_is_written_at_the_figures_size(tmp_path):
    path = tmp_path / "snapshot.png"
    summary = _fragmented(6)
    plot_snapshot(summary, str(path))
    width, height = build_figure(summary).get_size_inches()
    pixels = imread(str(path))
    rows, columns = pixels.shape[:2]
    assert abs(rows - height * DPI) < 1 and abs(columns - width * DPI) < 1  # whole pixels, cut or rounded


def test_a_snapshot_dictionary_is_drawn_too_and_one_without_segments_is_refused(tmp_path):
    data = S.snapshot([S.segment([S.block(3 * MiB), S.block(MiB, "inactive")])])
    plot_snapshot(data, str(tmp_path / "plain.png"))
    assert imread(str(tmp_path / "plain.png")).shape[0] > 0
    assert build_figure(data).axes[0].get_xlabel() == "offset within the segment (MiB)"
    with pytest.raises(ValueError, match="nothing to draw"):
        build_figure(S.snapshot([], {0: [S.alloc(MiB)]}))
