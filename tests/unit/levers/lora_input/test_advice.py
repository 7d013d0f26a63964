"""The plan's side-by-side of the LoRA-A input strategies on the config as is (``levers/lora_input/advice.compare``)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

S, B, H, T, LAYERS, BF16 = 512, 1, 64, 2, 2, 2
ELIGIBLE = 2
"""linear_qkv and linear_fc1: the column-parallel adapters whose LoRA-A takes the sequence-parallel gather."""


@pytest.fixture(scope="module")
def plan():
    from tests.unit.cli.test_plan import small_plan

    return small_plan(gpu_memory=80 * 2**30)


def test_each_strategy_is_estimated_on_the_config_as_is_even_when_it_fits(plan):
    assert plan.fits_as_is and not plan.options
    assert [p.strategy for p in plan.strategies] == ["off", "regather", "shard_local"]
    off = plan.strategies[0]
    assert (off.peak_bytes, off.reason) == (plan.baseline.peak_bytes, "as is")


def test_the_savings_are_the_gathered_inputs_less_their_shards_from_the_shapes(plan):
    """Off keeps each eligible LoRA-A's gathered [s, b, h] input; both strategies keep its [s/t, b, h] shard.
    shard_local's peak falls by exactly that; regather's by that less the [s, b, h] buffer it gathers into in
    backward, which Megatron's global memory buffer keeps."""
    off, regather, shard_local = plan.strategies
    gathered_less_shard = LAYERS * ELIGIBLE * S * B * H * BF16 * (T - 1) // T
    assert off.lora_input_bytes - regather.lora_input_bytes == gathered_less_shard
    assert off.lora_input_bytes - shard_local.lora_input_bytes == gathered_less_shard
    assert off.peak_bytes - shard_local.peak_bytes == gathered_less_shard
    assert off.peak_bytes - regather.peak_bytes == gathered_less_shard - S * B * H * BF16


def test_no_comparison_without_sequence_parallelism():
    from megatron_bridge_ext import planner
    from megatron_bridge_ext.peft import LoRA
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=2, hidden=64, ffn=256, heads=8, kv_heads=4, seq=512, micro_batch=1, vocab=128, tp=1,
                         dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, LoRA(target_modules=list(shape.lora_targets), dim=shape.lora_rank, alpha=16))
    result = planner.plan(cfg, gpu_memory=80 * 2**30, expandable_segments=False)
    assert result.strategies == [] and result.as_dict()["lora_input_strategies"] == []


def test_the_text_and_json_carry_each_strategy(plan):
    from megatron_bridge_ext.cli.plan import format_plan
    from megatron_bridge_ext.estimate.report import gib

    text = format_plan(plan).splitlines()
    off, regather, shard_local = plan.strategies
    assert f"  shard_local: peak {gib(shard_local.peak_bytes)}, LoRA inputs {gib(shard_local.lora_input_bytes)}, saves " \
           f"{gib(off.peak_bytes - shard_local.peak_bytes)} against off" in text
    assert [p["strategy"] for p in plan.as_dict()["lora_input_strategies"]] == ["off", "regather", "shard_local"]


def test_a_walking_plan_estimates_the_config_with_shard_local_once(monkeypatch):
    """Step 2 is ``shard_local`` on the config as is, which the comparison has estimated already: it reuses that
    estimate (the same peak) instead of tracing the same config again (the walk's estimates alone are counted: the
    combined answer after it is left out)."""
    import megatron_bridge_ext.estimate as estimate_package
    from megatron_bridge_ext import planner
    from tests.unit.cli.test_plan import small_plan

    monkeypatch.setattr(planner.reachable, "answer", lambda *args, **kwargs: None)

    real, seen = estimate_package.estimate, []

    def counting(cfg, **kwargs):
        seen.append((getattr(cfg.peft, "sequence_parallel_input_strategy", None), cfg.model.recompute_granularity,
                     cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size,
                     bool(getattr(cfg.optimizer, "optimizer_cpu_offload", False))))
        return real(cfg, **kwargs)

    monkeypatch.setattr(estimate_package, "estimate", counting)
    plan = small_plan(gpu_memory=1)
    [step2] = [o for o in plan.options if o.step == 2]
    assert step2.applicable and step2.peak_bytes == plan.strategies[2].peak_bytes
    assert seen.count(("shard_local", None, 2, 1, False)) == 1  # the optimizer-offload option is another config


def test_full_fine_tuning_is_told_the_lever_is_for_lora_runs_only():
    """No PEFT: step 2 is n/a as out of the lever's scope, not a fix that turns the run into LoRA, and the walk
    goes on to step 3."""
    from megatron_bridge_ext import planner
    from megatron_bridge_ext.cli.plan import format_plan
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=2, hidden=64, ffn=256, heads=8, kv_heads=4, seq=512, micro_batch=1, vocab=128, tp=2,
                         dtype="bfloat16", swiglu=True)
    result = planner.plan(tiny_config(shape, None), gpu_memory=1, expandable_segments=False)
    step2 = [o for o in result.options if o.step == 2]
    assert len(step2) == 1 and not step2[0].applicable
    assert "applies to LoRA runs only" in step2[0].reason and "full fine-tuning" in step2[0].reason
    assert any(o.step == 3 for o in result.options)
    text = format_plan(result)
    assert "found NoneType" not in text and "set cfg.peft" not in text
