"""``mbx demo`` / ``mbx bench memory`` options in the parent process: the PEFT kind, refused before any rank starts."""

import pytest

from megatron_bridge_ext.demo import bench, options, train
from megatron_bridge_ext.testing import variants

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("main", [bench.main, train.main], ids=["bench", "demo"])
def test_an_unknown_kind_exits_2_naming_the_option(main, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--peft", "qlora"])
    assert exited.value.code == 2
    assert "--peft" in capsys.readouterr().err


def test_a_variant_the_kind_lacks_is_refused_in_one_line(capsys):
    assert bench.main(["--peft", "dora", "--variants", "baseline", "upstream_regather"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--variants" in err[0] and "DoRA has no sequence_parallel_input_regather" in err[0]


@pytest.mark.parametrize("kind, swiglu", [("lora", False), ("dora", False), ("canonical_lora", True)])
def test_the_kind_reaches_the_shape(kind, swiglu):
    shape = options.shape_from_args(bench.parser().parse_args(["--peft", kind]))
    assert (shape.peft, shape.swiglu) == (kind, swiglu)


def test_default_variants_per_kind():
    assert "upstream_regather" not in [v.name for v in variants.select(None, "canonical_lora")]
    assert {"baseline", "regather", "shard_local"} <= {v.name for v in variants.select(None, "dora")}


def test_bench_save_into_a_missing_folder_exits_2_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exited:
        bench.main(["--save", "/nonexistent/folder/bench"])
    assert exited.value.code == 2
    assert "--save" in capsys.readouterr().err


@pytest.mark.parametrize("main", [bench.main, train.main], ids=["bench", "demo"])
def test_save_into_a_missing_folder_exits_2_naming_the_option_for_both_commands(main, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--save", "/nonexistent/folder/out"])
    assert exited.value.code == 2
    assert "--save" in capsys.readouterr().err


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
