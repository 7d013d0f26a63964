"""`mbx demo`'s table: the saving column against the first row, and its legend."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.demo import train

pytestmark = [pytest.mark.unit]


def _row(variant: str, saved: int, rank: int = 0) -> dict:
    return {"variant": variant, "rank": rank, "losses": [1.0, 0.5], "saved_bytes_per_step": [saved, saved],
            "split": {c: 0 for c in train.CATEGORIES}, "core_attn_recompute": {"checkpointed_forwards": 0,
                                                                              "recomputed": 0}, "lora_report": []}


def test_the_demo_table_has_a_saving_column_against_the_first_row_and_a_legend():
    from megatron_bridge_ext.testing import tiny_model

    base, ours = 4 * 2**20, 3 * 2**20  # a quarter of the baseline's bytes saved
    rows = [_row("baseline", base), _row("baseline", base, rank=1), _row("shard_local", ours),
            _row("shard_local", ours, rank=1)]
    lines = train.format_table(tiny_model.TinyGPTShape(), rows, "2 ranks (gloo, cpu)").splitlines()
    header, _, first, second, legend = lines[1:]
    assert "saving vs baseline" in header
    assert "0 B (0.0%)" in first and f"{base - ours:,} B (25.0%)" in second
    assert legend.startswith("saving vs baseline: saved/step of the first row (baseline) minus this row's")
