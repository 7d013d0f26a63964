"""Bridge's and Megatron-LM's memory report lines and the layout lines, read back into bytes (CPU only)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.diagnose.memory_lines import parse_layout, parse_report, parse_theoretical
from tests.support.oom_logs import bridge_layout_lines, bridge_memory_line, bridge_stats, megatron_memory_line

pytestmark = pytest.mark.unit
GB = 10**9


@pytest.mark.parametrize("nbytes", [123_456_789_012, 7_654_321_098, 987_654_321, 0])
def test_bridge_report_bytes_lie_within_its_five_significant_digits(nbytes):
    stats = bridge_stats(nbytes, nbytes + 1_234_567_891, nbytes + 2 * GB, nbytes + 3 * GB, retries=4)
    report = parse_report(bridge_memory_line(5, 2, stats))
    assert (report.source, report.rank, report.iteration, report.retries) == ("bridge", 5, 2, 4)
    for field, key in (("allocated", "allocated_bytes.all.current"), ("max_allocated", "allocated_bytes.all.peak"),
                       ("reserved", "reserved_bytes.all.current"), ("max_reserved", "reserved_bytes.all.peak")):
        # 5 significant digits of a figure in GB: half a unit of the fifth digit
        half_unit = 0 if stats[key] == 0 else 0.5 * 10 ** (len(str(int(stats[key] / GB))) - 5) * GB
        if stats[key] < GB:
            half_unit = 0.5 * 10 ** (len(str(stats[key])) - 5)
        assert abs(report.get(field) - stats[key]) <= half_unit + 1, field
        assert report.rounding[field] >= abs(report.get(field) - stats[key])


def test_megatron_report_is_mebibytes():
    report = parse_report(megatron_memory_line(3, 10, 5 << 30, 6 << 30, 7 << 30, 8 << 30))
    assert report.source == "megatron" and report.rank == 3 and report.iteration == 10
    assert (report.get("allocated"), report.get("max_allocated"), report.get("reserved"),
            report.get("max_reserved")) == (5 << 30, 6 << 30, 7 << 30, 8 << 30)


def test_a_line_with_a_prefix_and_other_words_is_still_read():
    line = "[default1]:" + bridge_memory_line(1, 1, bridge_stats(GB, 2 * GB, 3 * GB, 4 * GB))
    assert parse_report(line).get("max_reserved") == 4 * GB
    assert parse_report("iteration 1/ 100 | lm loss: 3.2 |") is None


def test_bridge_theoretical_line_is_mebibytes():
    t = parse_theoretical("Theoretical memory footprints: weight and optimizer=1024.00 MB, activation=512.00 MB, "
                          "total=1536.00 MB")
    assert (t.weight_and_optimizer, t.activation, t.total) == (1 << 30, 1 << 29, 3 << 29)
    assert parse_theoretical("Theoretical memory footprints: weight and optimizer=2048.00 MB").activation is None


def test_layout_lines_of_bridge_and_megatron():
    found = [pair for line in bridge_layout_lines(tp=2, pp=4, cp=2, ep=8) for pair in parse_layout(line)]
    assert sorted(set(found)) == [("cp", 2), ("ep", 8), ("pp", 4), ("tp", 2)]
    megatron = ("using world size: 16, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel "
                "sizes: None, tensor-model-parallel size: 4, encoder-tensor-model-parallel size: 0, "
                "pipeline-model-parallel size: 2, encoder-pipeline-model-parallel size: 0")
    assert dict(parse_layout(megatron)) == {"world": 16, "dp": 2, "cp": 1, "tp": 4, "pp": 2}
