"""``mbx demo`` / ``mbx bench memory`` options in the parent process: the PEFT kind, refused before any rank starts."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.demo import bench, options, train

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


@pytest.mark.parametrize("main", [bench.main, train.main], ids=["bench", "demo"])
def test_save_into_a_missing_folder_exits_2_naming_the_option_for_both_commands(main, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--save", "/nonexistent/folder/out"])
    assert exited.value.code == 2
    assert "--save" in capsys.readouterr().err
