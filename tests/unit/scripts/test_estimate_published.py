"""``scripts/estimate_published.py``'s selection of what to compare and the overrides its lever cases apply.

The overrides are checked on the config ``configs.build`` makes of them (what ``mbx plan`` builds), not by reading
the override strings back: a list the override parser does not take, or a field the model does not read, fails here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("estimate_published", ROOT / "scripts" / "estimate_published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lora_runs_the_named_model_only(script):
    assert script.selected("lora", "gpt-oss-120b") == [("lora", "gpt-oss-120b")]


def test_a_lever_runs_its_cases_whatever_the_model(script):
    assert script.selected("recompute", "qwen3-8b") == [("recompute", "")]


def test_all_runs_every_model_s_lora_then_every_lever_once(script):
    chosen = script.selected("all", "qwen3-8b")
    kinds = [kind for kind, _ in chosen]
    assert [name for kind, name in chosen if kind == "lora"] == list(script.MODELS)
    assert kinds[len(script.MODELS):] == list(script.LEVERS)
    assert kinds.index(next(iter(script.LEVERS))) == len(script.MODELS)


def test_an_unknown_lever_is_refused(script):
    with pytest.raises(ValueError, match="unknown lever"):
        script.selected("fsdp", "qwen3-8b")


def test_the_command_line_refuses_an_unknown_lever_before_estimating(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--lever", "fsdp"])
    assert "invalid choice" in capsys.readouterr().err


def test_every_case_of_a_lever_has_its_own_config(script):
    """No two rows of a table estimate the same overrides, and each published figure is a positive byte count."""
    for levers in script.LEVERS.values():
        for lever in levers:
            overrides = [tuple(case.overrides) for case in lever.cases]
            assert len(set(overrides)) == len(overrides), lever.title
            assert all(case.published is None or case.published > 0 for case in lever.cases)
            assert lever.source.startswith(script.BRIDGE)


def _built(script, lever, case):
    from megatron_bridge_ext.estimate import configs

    return configs.build(configs.Layout(**lever.layout), [*lever.overrides, *case.overrides], recipe=lever.recipe,
                         hf_config=str(ROOT / "tests" / "data" / lever.hf_config / "config.json")).cfg


def test_the_recompute_cases_set_the_modules_they_name(script):
    lever = script.LEVERS["recompute"][0]
    for case in lever.cases:
        model = _built(script, lever, case).model
        named = case.label.split("[", 1)[1].rstrip("]")
        assert model.recompute_granularity == "selective"
        assert list(model.recompute_modules) == [m for m in named.split(", ") if m], case.label


def test_the_graph_case_captures_the_published_scope_and_the_other_captures_nothing(script):
    from megatron.core.transformer.cuda_graph_config import normalize_cuda_graph_modules

    lever = script.LEVERS["cuda-graphs"][0]
    off, on = (_built(script, lever, case).model for case in lever.cases)
    assert off.cuda_graph_impl == "none" and on.cuda_graph_impl == "transformer_engine"
    scopes = {s.name for s in normalize_cuda_graph_modules(on.cuda_graph_modules)[0]}
    assert scopes == {"attn", "moe_router", "moe_preprocess"}
    assert on.recompute_granularity is None and off.recompute_granularity is None


def test_the_offload_cases_offload_the_fraction_they_name(script):
    lever = script.LEVERS["optimizer-offload"][0]
    reference, *offloaded = lever.cases
    assert not _built(script, lever, reference).optimizer.optimizer_cpu_offload
    for case in offloaded:
        optimizer = _built(script, lever, case).optimizer
        assert optimizer.optimizer_cpu_offload
        assert optimizer.optimizer_offload_fraction == float(case.label.rsplit(" ", 1)[1])
