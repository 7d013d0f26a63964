"""The per-rank picture of ``mbx diagnose --plot`` (``diagnose/plot.py``): its stage labels clear of its title."""

from __future__ import annotations

import pytest

from tests.unit.diagnose.test_collect import DP, _run_lines, _write

pytestmark = pytest.mark.unit


def _drawn_figure(tmp_path, monkeypatch):
    """The figure ``plot.draw`` saves, kept open (``plt.close`` records it instead)."""
    import matplotlib.pyplot as plt

    from megatron_bridge_ext.diagnose import plot
    from megatron_bridge_ext.diagnose.collect import diagnose_inputs

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    plot.draw(diagnose_inputs([_write(tmp_path / "t.log", _run_lines())], sizes={"dp": DP}), str(tmp_path / "p.png"))
    return figures[0]


def test_the_stage_labels_do_not_overlap_the_title(tmp_path, monkeypatch):
    """Each stage label's box on the rendered figure is clear of the title's (two lines with the layout)."""
    fig = _drawn_figure(tmp_path, monkeypatch)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text().startswith("stage ")]
    assert [t.get_text() for t in labels] == ["stage 0", "stage 1"]
    title = ax.title.get_window_extent(renderer)
    for label in labels:
        box = label.get_window_extent(renderer)
        assert not box.overlaps(title), (label.get_text(), box, title)
