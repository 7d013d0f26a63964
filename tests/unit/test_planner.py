"""The decision procedure on crafted configs: each device size is placed between two estimates so
that exactly one lever is the first to fit.

The configs are the demo's tiny GPT (bf16, SwiGLU, GQA) through ``tiny_config``, with Bridge's LoRA
path (``off``), sequence parallelism and a long enough sequence that activations dominate. Device
sizes come from estimates of the configs each lever leads to; what is tested is the order and the
answer (MemoryConfig, overrides, constraints), not the estimate's numbers (the grid tests those).
"""

from __future__ import annotations

import os

import pytest

from megatron_bridge_ext import planner
from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.levers.recompute import advice as recompute_advice

pytestmark = [pytest.mark.unit]


def _cfg(*, tp=2, pp=1, dp=1, layers=4):
    from megatron_bridge_ext.peft import LoRA
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=layers, hidden=64, ffn=256, heads=8, kv_heads=4, seq=1024, micro_batch=2, vocab=128,
                         tp=tp, dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape, LoRA(target_modules=list(shape.lora_targets), dim=shape.lora_rank, alpha=16,
                                  sequence_parallel_input_strategy="off"),
                      pipeline_model_parallel_size=pp)
    cfg.data_parallel_size = dp
    cfg.train.global_batch_size = shape.micro_batch * dp * pp
    return cfg


def _peak(cfg, **flags) -> int:
    from megatron_bridge_ext.estimate import estimate

    if flags:
        MemoryConfig(expandable_segments=False, **flags).apply(cfg)
    return estimate(cfg).peak_bytes


def _device_for(usable: float, margin: float) -> int:
    """The device size whose usable share (after ``margin``) is ``usable``."""
    return int(usable / (1 - margin))


def _plan(cfg, gpu):
    return planner.plan(cfg, gpu_memory=gpu, expandable_segments=False)


@pytest.fixture
def walk_only(monkeypatch):
    """The decision order alone: the combined answer, which on a device nothing fits walks every combination of the
    levers, is left out of plans that look at the table only."""
    monkeypatch.setattr(planner.reachable, "answer", lambda *args, **kwargs: None)


def _walked(result):
    """The first option of the decision order that fits (the table's; the answer may combine levers faster)."""
    return next((o for o in result.options if o.fits), None)


def test_fits_as_is():
    cfg = _cfg()
    result = _plan(cfg, 10 * _peak(_cfg()))
    assert result.fits_as_is and result.options == [] and result.chosen is None
    assert result.bridge is not None and result.bridge.total_bytes > 0


def _full_fine_tuning_cfg():
    """The tiny model without a PEFT, bf16 with a bf16 gradient buffer and a short sequence: every parameter is
    trainable, so the first step's fp32 copies of the gradients (4 B each) outweigh the few activations."""
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=2, hidden=64, ffn=256, heads=8, kv_heads=4, seq=16, micro_batch=1, vocab=128, tp=2,
                         dtype="bfloat16", swiglu=True)
    cfg = tiny_config(shape)
    cfg.ddp.grad_reduce_in_fp32 = False
    cfg.data_parallel_size = 1
    return cfg


def test_a_config_whose_first_step_does_not_fit_does_not_fit_as_is_and_the_levers_are_walked():
    """The verdict is on the largest phase: with the device between the steady state's peak and the first step's,
    the config does not fit as is (the first step would fail), so the plan walks the levers."""
    from megatron_bridge_ext.estimate import estimate, phases

    est = estimate(_full_fine_tuning_cfg())
    by_name = {p.name: p.peak_bytes for p in est.phases}
    assert est.peak_phase.name == phases.FIRST_STEP and by_name[phases.FIRST_STEP] > by_name[phases.STEADY]
    usable = (by_name[phases.FIRST_STEP] + by_name[phases.STEADY]) // 2
    result = _plan(_full_fine_tuning_cfg(), _device_for(usable, planner.MARGIN) + 1)
    assert result.usable_now >= by_name[phases.STEADY] and result.usable_now < by_name[phases.FIRST_STEP]
    assert result.fits_as_is is False
    assert result.options and result.options[0].step == 1


def test_fragmentation_only_is_fixed_by_expandable_segments():
    peak = _peak(_cfg())
    # Fits under the expandable-segments margin, not under the fragmentation margin.
    gpu = _device_for(peak * 1.01, planner.EXPANDABLE_MARGIN)
    assert gpu * (1 - planner.MARGIN) < peak
    result = _plan(_cfg(), gpu)
    assert not result.fits_as_is
    assert [o.step for o in result.options] == [1]
    assert _walked(result).lever == "allocator"
    # the answer: the layout as given with expandable segments, and shard_local, the one lever here that is faster
    # (less traffic) as well as leaner: it lowers the peak, so it stays
    shard_local = _peak(_cfg(), sequence_parallel_input_strategy="shard_local")
    answer = result.chosen
    assert answer.label == "as given, sequence_parallel_input_strategy shard_local" and answer.peak_bytes == shard_local
    assert answer.saves == {"sequence_parallel_input_strategy shard_local": peak - shard_local}
    assert answer.cost.step_time_pct < 0
    assert result.memory_config() == MemoryConfig(expandable_segments=True, sequence_parallel_input_strategy="shard_local")
    assert not any(o.startswith("model.") for o in result.overrides())


def test_needs_the_lora_input_under_sequence_parallelism():
    peak, shard_local = _peak(_cfg()), _peak(_cfg(), sequence_parallel_input_strategy="shard_local")
    assert shard_local < peak
    result = _plan(_cfg(), _device_for((peak + shard_local) / 2, planner.EXPANDABLE_MARGIN))
    assert [o.step for o in result.options] == [1, 2]
    chosen = _walked(result)
    assert chosen.step == 2 and chosen.peak_bytes == shard_local
    assert chosen.flags == {"expandable_segments": True, "sequence_parallel_input_strategy": "shard_local"}
    # cfg.peft was set in Python: no override reaches it, and the answer says how to set it instead
    assert not any("peft" in o for o in chosen.overrides)
    assert chosen.peft_note.endswith("MemoryConfig(expandable_segments=True, sequence_parallel_input_strategy='shard_local').apply(cfg)")
    assert chosen.cost.collective_bytes < 0  # shard_local moves r*h-sized tensors instead of s*b*h ones


def test_needs_selective_recompute():
    """Each candidate module is estimated on its own first; here core_attn raises the peak (the estimate's fused
    attention keeps no s x s tensor to drop, and the recompute adds its transient) and is reported as saving
    nothing, while layernorm and mlp save. The device sits between the peak with both recomputed and the lower of
    the two alone, so the answer must recompute both, the cheaper per byte saved first: layernorm (no GEMM), then
    mlp. Its FLOPs by hand from the shape (4 layers, 1 microbatch, TP 2): mlp repeats fc1 (h -> 2 ffn/t, SwiGLU)
    and fc2 (ffn/t -> h), 2 s b h (ffn/t) x 3 per layer; layernorm repeats none."""
    with_shard_local = dict(sequence_parallel_input_strategy="shard_local")
    shard_local = _peak(_cfg(), **with_shard_local)
    alone = {m: _peak(_cfg(), **with_shard_local, recompute_modules=[m]) for m in recompute_advice.RECOMPUTE_CANDIDATES}
    assert [m for m, peak in alone.items() if peak < shard_local] == ["layernorm", "mlp"]
    both = _peak(_cfg(), **with_shard_local, recompute_modules=["layernorm", "mlp"])
    assert both < min(alone["layernorm"], alone["mlp"])
    result = _plan(_cfg(), _device_for((both + min(alone["layernorm"], alone["mlp"])) / 2, planner.EXPANDABLE_MARGIN))
    chosen = _walked(result)
    assert chosen.step == 3 and chosen.flags["recompute_modules"] == ["layernorm", "mlp"]
    assert chosen.peak_bytes == both
    assert [o.step for o in result.options if o.applicable][:2] == [1, 2]
    [core_attn] = [o for o in result.options if o.label == "recompute core_attn"]
    assert not core_attn.applicable and core_attn.reason == "saves nothing here (measured)"
    s, b, h, ffn, tp, layers = 1024, 2, 64, 256, 2, 4
    mlp = 2 * s * b * h * (ffn // tp) * 3
    assert chosen.cost.recomputed_flops == mlp * layers  # the modules this option added: layernorm and mlp
    assert "model.recompute_granularity=selective" in chosen.overrides


def test_needs_tp_times_two_when_pp_does_not_help(walk_only):
    everything_fails = _plan(_cfg(dp=2), 1)
    by_label = {o.label.split(",")[0]: o for o in everything_fails.options if o.step == 4}
    pp, tp = by_label["PP 1 -> 2"], by_label["TP 2 -> 4"]
    best_before = min(o.peak_bytes for o in everything_fails.options if o.applicable and o.step < 4)
    # Under 1F1B the first stage holds twice the microbatches on half the layers: PP x 2 saves little here.
    assert tp.peak_bytes < min(pp.peak_bytes, best_before)
    result = _plan(_cfg(dp=2), _device_for((tp.peak_bytes + min(pp.peak_bytes, best_before)) / 2,
                                           planner.EXPANDABLE_MARGIN))
    chosen = _walked(result)
    assert chosen.step == 4 and chosen.label.startswith("TP 2 -> 4")
    assert "model.tensor_model_parallel_size=4" in chosen.overrides
    assert "TP 4->8: -28.4%" in chosen.cost.published


def test_pipeline_parallelism_blocks_cpu_offloading():
    result = _plan(_cfg(pp=2), 1)
    assert result.chosen is None
    offload = [o for o in result.options if o.step == 5 and "layers" in o.label]
    assert len(offload) == 1 and not offload[0].applicable
    assert [c.code for c in offload[0].constraints] == ["offload_with_pp"]
    parallel = [o for o in result.options if o.step == 4]
    assert parallel and all(not o.applicable and o.constraints[0].code == "needs_gpus" for o in parallel)


def test_the_offloading_step_offers_the_optimizer_offload_with_its_states_on_the_host_and_its_step_time():
    """Beside activation offloading (refused under PP) the optimizer offloaded whole: Adam's two fp32 moments leave
    the GPU, the fp32 gradient buffer and main copies stay (DP 1: 4 + 4 of 4 + 4 + 8 bytes an element), and the
    host's step makes it slower than the same estimate priced without the offload."""
    from dataclasses import replace

    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.levers import steptime
    from megatron_bridge_ext.levers.step import breakdown

    result = _plan(_cfg(pp=2), 1)
    (option,) = [o for o in result.options if o.step == 5 and "optimizer" in o.label]
    assert option.applicable and "optimizer.optimizer_offload_fraction=1" in option.overrides
    before = breakdown(result.baseline)["gradients and optimizer"]
    assert option.breakdown["gradients and optimizer"] == before * (4 + 4) // (4 + 4 + 8)
    s = estimate(option.config).settings
    assert (s.optimizer_offload, s.optimizer_offload_overlap) == (1.0, True)
    priced = steptime.step_time(s, result.gpu, moe=None)
    assert priced.optimizer > steptime.step_time(replace(s, optimizer_offload=None), result.gpu).optimizer
    assert option.cost.step_time_pct == pytest.approx(steptime.change_pct(result.step_time, priced))


def test_a_device_size_of_zero_bytes_is_refused_in_bytes():
    """The Python API takes bytes: its refusal says so (the CLI reads units itself)."""
    from megatron_bridge_ext.findings import Refused

    with pytest.raises(Refused) as refused:
        _plan(_cfg(), 0)
    assert refused.value.one_line() == "gpu_memory: is 0. Fix: give the device's memory in bytes, e.g. 80 * 2**30 for 80 GiB"


# ------------------------------------------------------------------------------------------------
# Mixture of experts: EP x 2 is the first parallelism option, and it saves half the rank's expert weights.

MOE_LAYERS, EXPERTS, MOE_FFN, HIDDEN, MOE_TP = 4, 8, 256, 64, 2


def _moe_cfg():
    """The tiny GPT with an MoE MLP on every layer (alltoall dispatcher, top-2), full fine-tuning, the distributed
    optimizer, TP 2 x DP 2 and ETP 2 (EP 1): every rank holds all 8 experts at half width."""
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=MOE_LAYERS, hidden=HIDDEN, ffn=256, heads=8, kv_heads=4, seq=1024, micro_batch=2,
                         vocab=128, tp=MOE_TP, dtype="bfloat16", swiglu=True, experts=EXPERTS, topk=2,
                         moe_ffn=MOE_FFN, dispatcher="alltoall", ep=1, etp=MOE_TP)
    cfg = tiny_config(shape, None)
    cfg.optimizer.use_distributed_optimizer = True
    cfg.ddp.grad_reduce_in_fp32 = True  # Megatron DDP's main_grad buffer in fp32
    cfg.data_parallel_size = 2
    cfg.train.global_batch_size = shape.micro_batch * 2
    return cfg


def test_expert_parallelism_halves_the_expert_weights_first_in_step_4(walk_only):
    cfg = _moe_cfg()
    everything_fails = _plan(cfg, 1)
    step4 = [o for o in everything_fails.options if o.step == 4]
    assert [o.label.split(" ")[0] for o in step4] == ["EP", "PP", "ETP", "TP"]
    ep = step4[0]
    assert ep.label == "EP 1 -> 2, expert DP 2 -> 1" and ep.applicable
    before = [o for o in everything_fails.options if o.step < 4 and o.applicable][-1]  # the state step 4 starts from
    # Each rank held 8 experts x (fc1 64 -> 2 x 256, fc2 256 -> 64) / ETP 2 per layer; EP 2 keeps 4 of them: half
    # the expert weights (bf16) and their main_grad go. Their optimizer state stays: the distributed optimizer
    # divided it over expert DP 2, now 1, for half the parameters. Activations stay: under balanced routing a
    # rank's experts still receive tokens x top-k copies.
    expert_params = MOE_LAYERS * EXPERTS * (HIDDEN * 2 * MOE_FFN + MOE_FFN * HIDDEN) // MOE_TP
    saved = expert_params // 2 * (2 + 4)  # bf16 weight, fp32 main_grad
    assert ep.peak_bytes == before.peak_bytes - saved
    assert ep.breakdown["weights"] == before.breakdown["weights"] - expert_params // 2 * 2
    assert ep.config.model.expert_model_parallel_size == 2 and ep.config.data_parallel_size == 2  # the dense DP kept

    result = _plan(_moe_cfg(), _device_for((ep.peak_bytes + before.peak_bytes) / 2, planner.EXPANDABLE_MARGIN))
    chosen = _walked(result)
    assert chosen.step == 4 and chosen.label == ep.label
    assert "model.expert_model_parallel_size=2" in chosen.overrides
    assert chosen.cost.collective_bytes == ep.cost.collective_bytes and "EP over TP" in chosen.cost.published


def test_the_decision_order_does_not_block_itself_on_moe(walk_only):
    """At TP 1 with EP 2 and the config's own recompute: TP x 2 turns SP on (Core's MoE layer refuses TP > 1
    without it) and offloading turns the recompute off (the two exclude each other), so neither is refused for a
    setting the walk left as it was."""
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    shape = TinyGPTShape(layers=MOE_LAYERS, hidden=HIDDEN, ffn=256, heads=8, kv_heads=4, seq=1024, micro_batch=2,
                         vocab=128, tp=1, dtype="bfloat16", swiglu=True, experts=EXPERTS, topk=2, moe_ffn=MOE_FFN,
                         dispatcher="alltoall", ep=2, etp=1)
    cfg = tiny_config(shape, None)
    cfg.model.recompute_granularity, cfg.model.recompute_modules = "selective", ["core_attn"]
    cfg.data_parallel_size, cfg.train.global_batch_size = 4, shape.micro_batch * 4
    result = _plan(cfg, 1)
    [tp] = [o for o in result.options if o.label.startswith("TP 1 -> 2")]
    assert tp.applicable and tp.label.endswith("SP on") and tp.config.model.sequence_parallel is True
    assert "model.sequence_parallel=true" in tp.overrides
    [offload] = [o for o in result.options if o.step == 5 and o.label.startswith("offload ")]  # the layers'
    assert offload.applicable and offload.label.endswith("(recompute turned off)")
    assert offload.config.model.recompute_granularity is None
    assert "model.recompute_granularity=null" in offload.overrides


# ------------------------------------------------------------------------------------------------
# The answer, pasted: every option's overrides through Bridge's own override parser (and, where the
# option says overrides cannot reach cfg.peft, its MemoryConfig) give the config the option estimated.

VANILLA = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"
WITH_LORA = "tests.support.plan_recipes:vanilla_gpt_with_lora"
TINY = ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_attention_heads=8",
        "model.vocab_size=1024", "model.share_embeddings_and_output_weights=false"]
OUR_LORA = ["+peft._target_=megatron_bridge_ext.peft.LoRA", "+peft.sequence_parallel_input_strategy=shard_local"]
QWEN3_RECIPE = "megatron.bridge.recipes.qwen.qwen3:qwen3_8b_peft_config"
QWEN3_8B = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "qwen3-8b", "config.json")


def _layout(**kwargs):
    from megatron_bridge_ext.estimate import configs

    return configs.Layout(tp=2, seq=1024, dp=1, **kwargs)  # DP 1 stated: a 1-GPU recipe at TP 2 needs a world size


def _walk_every_lever(layout, overrides, recipe, hf_config):
    """The plan of the built config on a device too small for anything: every lever is evaluated."""
    from megatron_bridge_ext.estimate import configs

    built = configs.build(layout, overrides, recipe=recipe, hf_config=hf_config)
    return built, planner.plan(built.cfg, gpu_memory=1, expandable_segments=False, with_bridge=False,
                               peft_overrides=built.peft_overrides)


def _pasted(layout, overrides, recipe, hf_config, built, option):
    """The user's run: the recipe with the user's and the plan's overrides on one command line (``--peft`` is
    among the plan's when overrides can build it), then the printed MemoryConfig where the option says so."""
    import dataclasses

    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_bridge_ext.estimate import configs

    by_overrides = built.peft_overrides is not None
    base = configs.build(dataclasses.replace(layout, peft=None) if by_overrides else layout, [], recipe=recipe,
                         hf_config=hf_config).cfg
    if base.model.should_pad_vocab:  # the build took the vocabulary from the tokenizer: the recipe leaves it unset
        base.model.vocab_size, base.model.should_pad_vocab = None, False
    cfg = process_config_with_overrides(base, cli_overrides=[*overrides, *option.overrides])
    configs.tokenizer_vocabulary(cfg, hf_config)  # Bridge's setup, after the overrides (training/setup.py L294-299)
    if option.peft_note:
        MemoryConfig(**option.flags).apply(cfg)
    return cfg


def _tree(cfg) -> dict:
    """Every serialisable field of the run config (Bridge's own conversion), the allocator's env_vars aside."""
    from omegaconf import OmegaConf

    from megatron.bridge.training.utils.omegaconf_utils import create_omegaconf_dict_config

    tree = OmegaConf.to_container(create_omegaconf_dict_config(cfg)[0])
    tree.pop("env_vars", None)
    return tree


def _peft(cfg):
    import dataclasses

    peft = cfg.peft
    return type(peft), {f.name: getattr(peft, f.name) for f in dataclasses.fields(peft) if f.init}


@pytest.mark.parametrize("recipe, layout, overrides, hf_config", [
    (VANILLA, {"peft": "lora"}, TINY, None),
    (VANILLA, {}, TINY + ["+peft._target_=megatron.bridge.peft.lora.LoRA", "+peft.dim=8"], None),
    (VANILLA, {"peft": "canonical_lora"}, TINY + ["+peft.dim=16"], None),
    (WITH_LORA, {}, TINY, None),
    (QWEN3_RECIPE, {}, ["model.num_layers=2"], QWEN3_8B),  # Bridge's own recipe, offline from config.json
], ids=["peft-flag", "peft-by-overrides", "peft-flag-with-overrides", "recipe-sets-peft", "qwen3-recipe-sets-peft"])
def test_every_printed_answer_reproduces_the_planned_config(recipe, layout, overrides, hf_config, walk_only):
    pytest.importorskip("hydra", reason="Bridge's override parser needs hydra-core")
    layout = _layout(**layout)
    built, result = _walk_every_lever(layout, overrides, recipe, hf_config)
    options = [o for o in result.options if o.applicable]
    assert {o.step for o in options} >= {2, 3}  # the LoRA input and recompute levers were evaluated
    for option in options:
        pasted = _pasted(layout, overrides, recipe, hf_config, built, option)
        assert _peft(pasted) == _peft(option.config), option.label
        assert _tree(pasted) == _tree(option.config), option.label
    lora = next(o for o in options if o.step == 2)
    assert lora.config.peft.strategy_in_effect == "shard_local"
    printed_peft = [o for o in lora.overrides if o.startswith(("+peft", "++peft"))]
    if built.peft_overrides is None:  # no override reaches the recipe's PEFT object: the note and Python line say so
        assert printed_peft == [] and "overrides cannot change this cfg.peft" in lora.peft_note
        assert "MemoryConfig(expandable_segments=True, sequence_parallel_input_strategy='shard_local').apply(cfg)" in lora.peft_note
    else:
        assert "++peft.sequence_parallel_input_strategy=shard_local" in printed_peft and lora.peft_note == ""


@pytest.mark.parametrize("recipe, layout, overrides", [
    (VANILLA, {"peft": "lora", "dp": 2}, TINY),
    (WITH_LORA, {"dp": 2}, TINY),
], ids=["peft-flag", "recipe-sets-peft"])
def test_the_combined_answer_pasted_reproduces_the_planned_config(recipe, layout, overrides):
    """The answer combining levers (a layout change among them, on a device that only the decision order's
    leanest option fits) as printed, pasted as the user would, gives the config it estimated."""
    pytest.importorskip("hydra", reason="Bridge's override parser needs hydra-core")
    from megatron_bridge_ext.estimate import configs

    layout = configs.Layout(tp=2, seq=1024, **layout)
    built, everything = _walk_every_lever(layout, overrides, recipe, None)
    leanest = min(o.peak_bytes for o in everything.options if o.applicable)
    built = configs.build(layout, overrides, recipe=recipe)
    result = planner.plan(built.cfg, gpu_memory=_device_for(leanest, planner.EXPANDABLE_MARGIN) + 1,
                          expandable_segments=False, with_bridge=False, peft_overrides=built.peft_overrides)
    answer = result.chosen
    assert answer.lever == "fastest combination" and answer.peak_bytes <= answer.usable_bytes
    pasted = _pasted(layout, overrides, recipe, None, built, answer)
    assert _peft(pasted) == _peft(answer.config)
    assert _tree(pasted) == _tree(answer.config)


def test_the_old_peft_overrides_change_nothing_on_a_recipe_that_sets_peft():
    """Why the answer gives a Python line there: Bridge restores the recipe's PEFT object over them."""
    pytest.importorskip("hydra", reason="Bridge's override parser needs hydra-core")
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from tests.support.plan_recipes import vanilla_gpt_with_lora

    import megatron_bridge_ext.peft.lora  # noqa: F401  (allowlists our _target_)

    cfg = vanilla_gpt_with_lora()
    before = cfg.peft
    assert process_config_with_overrides(cfg, cli_overrides=OUR_LORA).peft is before


def test_peft_flag_and_peft_overrides_build_one_peft(walk_only):
    """--peft lora plus the overrides that switch on our strategy: the plan traces the strategy."""
    pytest.importorskip("hydra", reason="Bridge's override parser needs hydra-core")
    from megatron_bridge_ext.estimate import configs
    from megatron_bridge_ext.peft import LoRA

    built = configs.build(_layout(peft="lora", lora_dim=16), TINY + OUR_LORA, recipe=VANILLA)
    peft = built.cfg.peft
    assert type(peft) is LoRA and peft.strategy_in_effect == "shard_local"
    assert (peft.dim, peft.target_modules) == (16, _layout().lora_targets)  # --peft's fields, the overrides' class
    result = planner.plan(built.cfg, gpu_memory=1, expandable_segments=False, with_bridge=False,
                          peft_overrides=built.peft_overrides)
    assert result.baseline.settings.peft.sequence_parallel_input_strategy == "shard_local"
    lora = next(o for o in result.options if o.step == 2)
    assert not lora.applicable and "already shard_local" in lora.reason


@pytest.mark.parametrize("layout, expected, noted", [
    ({"tp": 2}, True, True),  # --tp given: SP follows it, as for a config.json, and the config line says so
    ({"tp": 2, "sequence_parallel": False}, False, False),  # --no-sp
    ({}, False, False),  # no --tp: the recipe's own TP and SP stand
])
def test_sequence_parallelism_follows_tp_where_tp_is_given(layout, expected, noted):
    from megatron_bridge_ext.estimate import configs

    overrides = [] if layout else ["model.tensor_model_parallel_size=2"]  # the recipe's TP 2, its SP off
    built = configs.build(configs.Layout(dp=1, **layout), overrides, recipe=WITH_LORA)
    assert built.cfg.model.tensor_model_parallel_size == 2
    assert built.cfg.model.sequence_parallel is expected
    assert any(note.startswith("SP on") for note in built.notes) is noted


def test_sequence_parallelism_a_config_sets_at_tp_1_is_turned_off_as_bridge_turns_it_off():
    """Bridge's finalize drops SP at TP 1 (a recipe such as Step-3.5's sets both), so the plan does, and says so."""
    from megatron_bridge_ext.estimate import configs

    built = configs.build(configs.Layout(dp=1), ["model.sequence_parallel=true"], recipe=WITH_LORA)
    assert built.cfg.model.tensor_model_parallel_size == 1 and built.cfg.model.sequence_parallel is False
    assert any(note.startswith("SP off: the config sets sequence_parallel at TP 1") for note in built.notes)


def test_each_option_is_priced_in_step_time_against_the_config_as_is(walk_only):
    """Expandable segments change no time; adding mlp to layernorm recompute adds its forward GEMMs at the H100's
    dense bf16 peak (the default device) times the calibration's efficiency of their size: SwiGLU fc1 h -> 2 ffn/t
    and fc2 ffn/t -> h, 2 FLOPs per multiply-add, on the 4 layers of the one microbatch (global batch = micro-batch
    x DP), against the config's own step time."""
    from megatron_bridge_ext.levers import calibration

    result = _plan(_cfg(dp=2), 1)
    assert result.gpu.name == "h100" and result.step_time.total > 0
    by_label = {o.label: o for o in result.options if o.applicable}
    assert by_label["expandable segments"].cost.step_time_pct == 0.0
    seq, micro_batch, hidden, ffn, tp, layers = 1024, 2, 64, 256, 2, 4
    mlp_flops = 2 * seq * micro_batch * hidden * (ffn // tp) * 3 * layers
    added = (by_label["recompute_modules=['layernorm', 'mlp']"].cost.step_time_pct
             - by_label["recompute_modules=['layernorm']"].cost.step_time_pct)
    per_gemm = mlp_flops / layers / 2
    efficiency = calibration.GEMM_PEAK_FRACTION_BF16 * per_gemm / (per_gemm + calibration.GEMM_HALF_FLOPS)
    assert added == pytest.approx(100 * mlp_flops / (1979e12 / 2 * efficiency) / result.step_time.total, rel=1e-9)
    assert all(o.cost.step_time_pct is None for o in result.options if not o.applicable)


def _option(step: int, label: str, peak: int, pct: float, *, applicable: bool = True):
    from megatron_bridge_ext.levers.step import Cost, Option

    return Option(step, "lever", label, applicable, peak_bytes=peak if applicable else None, usable_bytes=2**40,
                  cost=Cost(step_time_pct=pct if applicable else None))


def test_equal_memory_options_of_a_step_are_put_fastest_first():
    gib = 2**30
    options = [_option(3, "recompute a", 10 * gib, 5.0),
               _option(4, "PP x 2", 8 * gib, 12.0), _option(4, "TP x 2", int(8 * gib * (1 + planner.EQUAL_PEAK_SHARE)), 30.0),
               _option(4, "EP x 2", 8 * gib, 3.0),
               _option(5, "offload", 8 * gib, 1.0)]  # equal peak, but a later step: the decision order stays
    ordered = planner.order_equal_memory(options)
    assert [o.label for o in ordered] == ["recompute a", "EP x 2", "PP x 2", "TP x 2", "offload"]


def test_the_answer_is_the_combination_unless_offloading_fits_faster():
    gib = 2**30
    combined = _option(0, "PP 2->4, DP 4->2", 9 * gib, 8.0)
    walked = [_option(3, "recompute a", 10 * gib, 5.0), _option(5, "offload", 8 * gib, 300.0)]
    assert planner.fastest_answer(combined, walked) is combined  # an earlier step that fits is no answer of itself
    quick_offload = _option(5, "offload", 8 * gib, 2.0)
    assert planner.fastest_answer(combined, walked[:1] + [quick_offload]) is quick_offload
    assert planner.fastest_answer(None, walked[1:]) is walked[1]  # no combination fits: offloading, which does
    assert planner.fastest_answer(None, [_option(4, "PP x 2", 8 * gib, 1.0, applicable=False)]) is None


def test_options_of_different_memory_or_not_applicable_keep_the_decision_order():
    gib = 2**30
    options = [_option(4, "PP x 2", 8 * gib, 12.0), _option(4, "TP x 2", int(8 * gib * 0.99), 3.0),
               _option(4, "n/a", 0, 0.0, applicable=False), _option(4, "later", 6 * gib, 1.0)]
    assert [o.label for o in planner.order_equal_memory(options)] == ["PP x 2", "TP x 2", "n/a", "later"]
