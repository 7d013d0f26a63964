"""``mbx plan --plot``: a title naming the config and the device, and option names under the bars that can be
read (no two labels overlap, measured on the drawn figure)."""

from __future__ import annotations

import itertools

import pytest

from megatron_bridge_ext.render import plan as render_plan
from megatron_bridge_ext.render import plan_plot
from megatron_bridge_ext.sizes import gib

pytestmark = [pytest.mark.unit]
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def result():
    from tests.unit.cli.test_plan import small_plan

    return small_plan(gpu_memory=1)  # nothing fits: every lever is tried and drawn


def _config_line(result) -> str:
    return render_plan.settings_line(result.baseline.settings)


def test_no_two_option_labels_overlap_and_each_is_drawn(result):
    import matplotlib.pyplot as plt

    fig = plan_plot.figure(result, _config_line(result))
    try:
        labels = fig.axes[0].get_xticklabels()
        applicable = [o for o in result.options if o.applicable and o.breakdown]
        assert len(labels) == 1 + len(applicable) >= 4  # enough long names to collide at the old width
        assert [t.get_text().split() for t in labels] == [s.split() for s in
                                                          ["as is", *(f"{o.step}: {o.label}" for o in applicable)]]
        boxes = [t.get_window_extent() for t in labels]
        for a, b in itertools.combinations(boxes, 2):
            assert a.x1 <= b.x0 or b.x1 <= a.x0, (a, b)  # side by side, never on top of each other
        assert max(len(line) for t in labels for line in t.get_text().splitlines()) <= max(
            plan_plot.LABEL_WIDTH, *(len(word) for t in labels for word in t.get_text().split()))
    finally:
        plt.close(fig)


def test_the_title_names_the_config_and_the_device(result):
    import matplotlib.pyplot as plt

    fig = plan_plot.figure(result, _config_line(result))
    try:
        title = " ".join(fig.axes[0].get_title(loc="left").split())
    finally:
        plt.close(fig)
    assert title.startswith(" ".join(_config_line(result).split()))
    assert f"device: {gib(result.gpu_memory)} per GPU, {result.gpu.name} step times" in title


def test_the_written_picture_holds_every_label_side_by_side(result, tmp_path):
    from PIL import Image

    path = tmp_path / "plan.png"
    plan_plot.plot(result, str(path), _config_line(result))
    import matplotlib.pyplot as plt

    fig = plan_plot.figure(result, _config_line(result))
    try:
        widths = sum(t.get_window_extent().width for t in fig.axes[0].get_xticklabels())
    finally:
        plt.close(fig)
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= widths and image.height >= 5 * 100 * 0.9  # 5 in at 100 dpi
