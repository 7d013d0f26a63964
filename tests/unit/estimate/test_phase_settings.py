"""Bridge's performance-configuration settings on a tiny GPT: each one honoured (the estimate changes as the setting
says) or refused by name; the mixed-precision and PEFT recipe names resolved before their dotted overrides."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.estimate import configs, estimate, phases
from megatron_bridge_ext.findings import Refused

pytestmark = [pytest.mark.unit]

RECIPE = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"
HIDDEN, VOCAB, SEQ = 64, 256, 64
TINY = ["model.num_layers=2", f"model.hidden_size={HIDDEN}", "model.num_attention_heads=4",
        f"model.ffn_hidden_size={4 * HIDDEN}", f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=128",
        "model.share_embeddings_and_output_weights=false"]


def _build(*overrides, pp=1, peft=None, global_batch=None):
    layout = configs.Layout(tp=1, pp=pp, dp=1, seq=SEQ, micro_batch=1, global_batch=global_batch, peft=peft)
    return configs.build(layout, TINY + list(overrides), recipe=RECIPE)


def _trainable(est) -> int:
    return int(est.component("gradients (main_grad buffer)").basis.split(" trainable")[0].replace(",", ""))


def test_mixed_precision_field_override_sets_a_two_byte_gradient_buffer():
    """``mixed_precision.grad_reduce_in_fp32=false``: the recipe name is resolved first, so the field applies."""
    on = estimate(_build("mixed_precision=bf16_mixed").cfg)
    off = estimate(_build("mixed_precision=bf16_mixed", "mixed_precision.grad_reduce_in_fp32=false").cfg)
    assert on.component("gradients (main_grad buffer)").bytes == _trainable(on) * 4
    assert off.component("gradients (main_grad buffer)").bytes == _trainable(off) * 2
    # a bf16 buffer is copied to fp32 for the main parameters in the step; a fp32 one is not
    assert phases.FP32_GRAD_COPIES in [c.name for c in off.step.transients]
    assert phases.FP32_GRAD_COPIES not in [c.name for c in on.step.transients]


def test_a_ddp_override_the_mixed_precision_recipe_replaces_is_said_in_one_line():
    built = _build("mixed_precision=bf16_mixed", "ddp.grad_reduce_in_fp32=false")
    lines = [n for n in built.notes if n.startswith("ddp.grad_reduce_in_fp32=false is replaced")]
    assert len(lines) == 1
    assert "grad_reduce_in_fp32=True trains" in lines[0] and "mixed_precision.grad_reduce_in_fp32=VALUE" in lines[0]
    est = estimate(built.cfg)
    assert est.component("gradients (main_grad buffer)").bytes == _trainable(est) * 4  # what Bridge trains with


def test_a_mixed_precision_field_without_a_recipe_name_is_refused_with_the_form_that_works():
    with pytest.raises(Refused) as refused:
        _build("mixed_precision=null", "mixed_precision.grad_reduce_in_fp32=false")
    assert "mixed_precision=bf16_mixed mixed_precision.grad_reduce_in_fp32=false" in refused.value.one_line()


def test_a_misspelt_mixed_precision_field_names_the_closest():
    with pytest.raises(Refused) as refused:
        _build("mixed_precision=bf16_mixed", "mixed_precision.grad_reduce_in_fp23=false")
    assert "did you mean mixed_precision.grad_reduce_in_fp32?" in refused.value.one_line()


def test_peft_field_with_peft_flag_changes_the_built_peft():
    built = _build("peft.dim=8", peft="lora")
    assert (built.cfg.peft.dim, built.cfg.peft.alpha) == (8, 32)
    assert not any(o.startswith("++peft.dim=") for o in built.peft_overrides)  # the answer keeps the user's value


def test_peft_field_without_a_peft_names_the_form_that_works():
    with pytest.raises(Refused) as refused:
        _build("peft.dim=8")
    line = refused.value.one_line()
    assert "--peft lora" in line and "++peft._target_=megatron.bridge.peft.lora.LoRA ++peft.dim=VALUE" in line


def _comm_overlap(*fields):
    return ["++comm_overlap._target_=megatron.bridge.training.comm_overlap.CommOverlapConfig",
            "++comm_overlap.tp_comm_overlap=false"] + [f"++comm_overlap.{f}" for f in fields]


@pytest.mark.parametrize("limit, microbatches", [(0, 4), (2, 4)])
def test_deferred_embedding_wgrad_is_held_on_the_last_stage(limit, microbatches):
    deferred = estimate(_build(*_comm_overlap("defer_embedding_wgrad_compute=true", f"wgrad_deferral_limit={limit}"),
                               pp=2, global_batch=microbatches).cfg)
    plain = estimate(_build(*_comm_overlap(), pp=2, global_batch=microbatches).cfg)
    held = min(limit, microbatches - 1) if limit else microbatches - 1
    padded_vocab = VOCAB  # a multiple of make_vocab_size_divisible_by x TP already
    extra = held * (SEQ * HIDDEN + SEQ * padded_vocab) * plain.element_size()  # the recipe's training dtype
    last = 1
    for name in (phases.ITERATION_1, phases.STEADY):
        assert deferred.stage_phase_peaks[last][name][0] - plain.stage_phase_peaks[last][name][0] == extra
    # drained before the step; the first stage has no output layer
    assert deferred.stage_phase_peaks[last][phases.FIRST_STEP] == plain.stage_phase_peaks[last][phases.FIRST_STEP]
    assert deferred.stage_phase_peaks[0] == plain.stage_phase_peaks[0]


def test_deferred_embedding_wgrad_without_pipeline_parallelism_is_refused_by_name():
    with pytest.raises(Refused) as refused:
        estimate(_build(*_comm_overlap("defer_embedding_wgrad_compute=true")).cfg)
    assert refused.value.one_line().startswith("model.defer_embedding_wgrad_compute: is on with PP=1")


def test_overlap_param_gather_with_the_optimizer_step_is_read_and_stated():
    cfg = _build("optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true",
                 "ddp.overlap_param_gather=true", "ddp.overlap_grad_reduce=true",
                 "optimizer.overlap_param_gather_with_optimizer_step=true", pp=2, global_batch=4).cfg
    step = next(p for p in estimate(cfg).phases if p.name == phases.FIRST_STEP)
    assert "overlap_param_gather_with_optimizer_step: the parameter all-gather writes into the parameter buffer" \
        in step.basis


@pytest.mark.parametrize("overrides, setting", [
    (("ddp.use_custom_fsdp=true",), "ddp.use_custom_fsdp"),
    (("ddp.use_megatron_fsdp=true", "checkpoint.ckpt_format=fsdp_dtensor",
      "ddp.num_distributed_optimizer_instances=2"),
     "ddp.num_distributed_optimizer_instances"),
    (("optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=false",
      "ddp.use_distributed_optimizer=false"), "optimizer.optimizer_cpu_offload"),
    (("optimizer.optimizer_cpu_offload=true", "optimizer.decoupled_weight_decay=false"),
     "optimizer.decoupled_weight_decay"),
    (("optimizer.optimizer=adaptive_muon",), "optimizer.optimizer"),
    (("optimizer.optimizer=dist_muon", "optimizer.use_distributed_optimizer=true",
      "ddp.use_distributed_optimizer=true"), "ddp.use_distributed_optimizer")])
def test_a_setting_the_estimate_cannot_honour_is_refused_by_name(overrides, setting):
    with pytest.raises(Refused) as refused:
        estimate(_build(*overrides).cfg)
    assert refused.value.one_line().startswith(f"{setting}: ")


def test_optimizer_cpu_offload_keeps_the_main_shard_and_the_gpu_share_of_the_moments():
    """DP 1: the shard is every trainable parameter; bf16 parameters, so an fp32 main copy of each stays on the GPU,
    and the moments (2 x 4 B) of the half not moved to the host."""
    est = estimate(_build("optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true",
                          "optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5").cfg)
    trainable = _trainable(est)
    on_host = -(-trainable // 2)
    assert est.component("optimizer states").bytes == trainable * 4 + (trainable - on_host) * 8
    assert any(a.startswith("optimizer CPU offload, optimizer_offload_fraction=0.5") for a in est.assumptions)
