"""The peak-memory part: its carried estimates are fresh, its bad options are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_bridge_ext.device_check import check, peak_memory


def test_consistency_the_carried_estimates_are_a_fresh_run_of_the_measured_configs(tmp_path):
    """A consistency check of the package data: every figure of estimates.json is what the estimate gives now for
    the config the device check measures (written again here); the estimate's own figures are tested by hand in
    tests/unit/estimate/."""
    committed = json.loads(Path(check.ESTIMATES).read_text())
    layers = {int(key.split("/")[1].removeprefix("layers=")) for key in committed}
    assert layers == {check.DEFAULT_LAYERS}
    fresh = peak_memory.write_estimates(str(tmp_path / "estimates.json"), layers.pop())
    assert fresh == committed, f"{check.ESTIMATES} is stale: python -m megatron_bridge_ext.device_check." \
                               f"peak_memory --write-estimates {check.ESTIMATES} --layers 4"


@pytest.mark.parametrize("argv, named", [
    (["--variant", "baseline", "--steps", "3"], "--steps=3"),
    (["--variant", "baseline", "--estimates", "/nonexistent/estimates.json"], "--estimates /nonexistent"),
    (["--variant", "baseline", "--estimate", "--estimates", check.ESTIMATES], "choose one"),
    (["--layers", "2"], "--variant is required"),
])
def test_peak_memory_refuses_bad_options_in_one_line(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        peak_memory.main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_a_committed_estimate_missing_for_the_layers_says_how_to_write_it():
    found = peak_memory.committed_estimate(check.ESTIMATES, "baseline", 7, False)
    assert "no estimate for qwen3-8b/layers=7/baseline" in found["error"]
    assert "--write-estimates" in found["error"]
