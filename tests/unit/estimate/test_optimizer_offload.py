"""Optimizer CPU offload, TE's master remainders, and the resume phase: bytes from element counts and dtype sizes,
and the offload's split against Megatron Core's own HybridDeviceOptimizer on fake CUDA tensors."""

from __future__ import annotations

import math
import types
from unittest import mock

import pytest
import torch

from megatron_bridge_ext.estimate import offload, phases, static
from megatron_bridge_ext.estimate.report import BUFFERS, STATIC, Component, MemoryEstimate
from tests.support.settings import gpt_stage, optimizer_config

pytestmark = [pytest.mark.unit]

TRAINABLE, DP = 1000, 4
SHARD = TRAINABLE // DP



def _offloaded(share, **fields):
    return optimizer_config(optimizer_cpu_offload=True, optimizer_offload_fraction=share, **fields)


def _shard(optimizer, *, trainable=TRAINABLE, param_bytes=2):
    counts = static.ParameterCounts(dict.fromkeys(static.PARTS, 0),
                                    {**dict.fromkeys(static.PARTS, 0), static.LAYERS: trainable}, param_bytes)
    rule = static.optimizer_rule(optimizer, param_bytes=param_bytes, data_parallel=DP, context_parallel=1)
    return rule, static.optimizer_shard(counts, rule)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_offload_keeps_the_whole_fp32_main_shard_and_the_gpu_share_of_the_fp32_moments(share):
    rule, shard = _shard(_offloaded(share))
    host = math.ceil(SHARD * share)
    assert shard.offloaded == host
    assert shard.masters == SHARD * 4  # distrib_optimizer.py L445: every element's fp32 main copy on the GPU
    assert shard.moments == (SHARD - host) * (4 + 4)


def test_offload_ignores_the_precision_aware_dtypes_and_keeps_only_the_gpu_share_of_the_main_copies():
    """Core passes no exp_avg dtypes to the hybrid optimizer and it makes fp32 copies of the 16-bit shard itself."""
    aware = _offloaded(0.5, use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                       exp_avg_sq_dtype=torch.bfloat16, main_params_dtype=torch.float16)
    rule, shard = _shard(aware)
    gpu = SHARD - math.ceil(SHARD * 0.5)
    assert (shard.masters, shard.moments) == (gpu * 4, gpu * 8)
    step = phases.step_state(aware, shard, rule, grad_bytes=4)
    assert not step.masters_in_step and step.transients == ()  # made at construction; fp32 states need no unscaling


def test_the_optimizer_states_line_is_the_shard_on_the_gpu():
    counts = static.ParameterCounts(dict.fromkeys(static.PARTS, 0),
                                    {**dict.fromkeys(static.PARTS, 0), static.LAYERS: TRAINABLE}, 2)
    rule = static.optimizer_rule(_offloaded(0.5), param_bytes=2, data_parallel=DP, context_parallel=1)
    line = next(c for c in static.static_components(counts, grad_bytes=4, rule=rule) if c.name == "optimizer states")
    assert line.bytes == SHARD * 4 + (SHARD - SHARD // 2) * 8


def _core_split(sizes, share, dtype):
    """Megatron Core's own parameter split of a HybridDeviceOptimizer over fake CUDA tensors of ``sizes``:
    (elements kept on the GPU, elements with an fp32 copy made on the GPU). Pinning host memory is an allocator
    choice fake tensors do not implement: it is taken as the tensor itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    with mock.patch.object(torch.Tensor, "pin_memory", lambda self, *a, **k: self), \
            FakeTensorMode(allow_non_fake_inputs=True):
        params = [torch.empty(n, dtype=dtype, device="cuda") for n in sizes]
        holder = types.SimpleNamespace(param_groups=[{"params": params}], param_update_in_fp32=True)
        _, gpu_groups, _, _, fp32 = HybridDeviceOptimizer._get_sub_optimizer_param_groups(holder, share)
        kept = sum(p.numel() for g in gpu_groups for p in g["params"])
        gpu_copies = sum(c.numel() for c in fp32.values() if c.is_cuda)
    return kept, gpu_copies


EQUAL = [25] * 8
"""Parameters of equal size whose quarters land on parameter boundaries: Core's whole-parameter cut is then the
element the estimate cuts at."""


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_cores_hybrid_optimizer_keeps_on_the_gpu_what_the_estimate_keeps(share):
    kept, _ = _core_split(EQUAL, share, torch.float32)
    _, shard = _shard(_offloaded(share), trainable=sum(EQUAL) * DP)
    assert shard.elements - shard.offloaded == kept
    assert shard.moments == kept * 8


def test_cores_cut_moves_whole_parameters_so_the_estimate_keeps_at_most_one_more_on_the_gpu():
    sizes = [100, 300, 50, 550]
    kept, _ = _core_split(sizes, 0.5, torch.float32)
    estimated = sum(sizes) - offload.host_elements(sum(sizes), 0.5)
    assert kept <= estimated < kept + max(sizes)


def test_cores_hybrid_optimizer_makes_fp32_copies_on_the_gpu_for_the_kept_16_bit_shard():
    kept, copies = _core_split(EQUAL, 0.5, torch.bfloat16)
    assert copies == kept
    _, shard = _shard(_offloaded(0.5, use_precision_aware_optimizer=True), trainable=sum(EQUAL) * DP)
    assert shard.masters == copies * 4


def test_an_emerging_optimizer_is_refused_by_name():
    assert static.optimizer_findings(optimizer_config()) == []
    assert [f.setting for f in static.optimizer_findings(optimizer_config(optimizer="adaptive_muon"))] == \
        ["optimizer.optimizer"]


@pytest.mark.parametrize("remainders, bf16, main", [(True, True, 2), (False, True, 4), (True, False, 4)])
def test_te_keeps_a_bf16_parameters_fp32_master_as_its_16_bit_remainder(remainders, bf16, main):
    aware = optimizer_config(use_precision_aware_optimizer=True, store_param_remainders=remainders, bf16=bf16)
    rule, shard = _shard(aware)
    assert rule.main_bytes == main
    assert (shard.masters, shard.moments) == (SHARD * main, SHARD * 8)


def test_no_remainders_where_core_keeps_the_masters():
    """Bridge's bf16 recipes copy fp8_recipe='tensorwise' into the optimizer: Core then keeps fp32 masters itself
    (use_precision_aware_optimizer_no_fp8_or_ds_fp8 is False) and passes FusedAdam no master weights."""
    aware = optimizer_config(use_precision_aware_optimizer=True, store_param_remainders=True, fp8_recipe="tensorwise")
    assert static.optimizer_rule(aware, param_bytes=2, data_parallel=DP, context_parallel=1).main_bytes == 4


def test_remainders_are_not_unscaled_in_the_step():
    """FusedAdam reads the int16 remainders as they are (get_unscaled_state returns the state for fp32 masters):
    with fp16 moments the step copies the two moments to fp32 and nothing for the masters."""
    aware = optimizer_config(use_precision_aware_optimizer=True, store_param_remainders=True,
                             exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    rule, shard = _shard(aware)
    step = phases.step_state(aware, shard, rule, grad_bytes=4)
    assert [(c.name, c.bytes) for c in step.transients] == [(phases.UNSCALED_STATES, SHARD * 4 * 2)]


def _resumed(optimizer):
    rule, shard = _shard(optimizer)
    step = phases.step_state(optimizer, shard, rule, grad_bytes=4, resume=True)
    components = [Component(STATIC, "weights: transformer layers", 2000, "w"),
                  Component(STATIC, "gradients (main_grad buffer)", 4000, "g"),
                  Component(STATIC, phases.OPTIMIZER_STATES, step.masters + step.moments, "o"),
                  Component(BUFFERS, "global memory buffer", 10, "b")]
    est = MemoryEstimate(stage=0, components=components, settings=gpt_stage(tp=2, dp=DP, cp=1), assumptions=[],
                         activations_per_microbatch={}, in_flight_microbatches=1.0, step=step)
    return step, {p.name: p for p in est.phases}, est


HELD = 2000 + 4000 + 10


def test_resuming_with_the_plain_optimizer_adds_no_copy_of_the_states():
    step, by_name, _ = _resumed(optimizer_config())
    assert step.load == ()
    assert by_name[phases.RESUME].peak_bytes == HELD + SHARD * (4 + 8)
    states = next(c.bytes for c in by_name[phases.ITERATION_1].components if c.name == phases.OPTIMIZER_STATES)
    assert states == SHARD * 12  # loaded before iteration 1


def test_resuming_the_precision_aware_optimizer_holds_its_states_twice():
    step, by_name, _ = _resumed(optimizer_config(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                                        exp_avg_sq_dtype=torch.bfloat16))
    assert by_name[phases.RESUME].peak_bytes == HELD + 2 * SHARD * (4 + 2 + 2)


def test_resuming_with_the_offload_brings_the_host_states_to_the_gpu():
    share = 0.75
    step, by_name, _ = _resumed(_offloaded(share))
    host = math.ceil(SHARD * share)
    states = SHARD * 4 + (SHARD - host) * 8
    dummy_grads, host_on_gpu = SHARD * 4, host * (8 + 4)
    assert by_name[phases.RESUME].peak_bytes == HELD + states + max(dummy_grads, host_on_gpu)


def test_a_fresh_run_has_no_resume_phase():
    rule, shard = _shard(optimizer_config())
    assert phases.step_state(optimizer_config(), shard, rule, grad_bytes=4).load is None


def test_a_recipes_load_directory_alone_does_not_make_a_resumed_run():
    from megatron_bridge_ext.estimate.memory import _resumes

    recipe = types.SimpleNamespace(load="/ckpt", load_optim=True, finetune=False, pretrained_checkpoint=None)
    assert _resumes(recipe, False) == (False, None)
    assert _resumes(recipe, True)[0]
    assert not _resumes(types.SimpleNamespace(**{**vars(recipe), "finetune": True}), True)[0]
    assert not _resumes(types.SimpleNamespace(**{**vars(recipe), "load_optim": False}), True)[0]


def test_the_first_report_of_a_resumed_run_shows_the_loads_peak_when_it_is_the_largest():
    """torch's peak is not reset between the load and the first report (predicted_reports)."""
    _, by_name, est = _resumed(optimizer_config(use_precision_aware_optimizer=True))
    first = phases.predicted_reports(est)[0]
    assert first.phase == phases.RESUME
    assert first.max_allocated_bytes == by_name[phases.RESUME].peak_bytes == HELD + 2 * SHARD * (4 + 8)


def test_resuming_the_non_distributed_optimizer_is_refused_by_name():
    from megatron_bridge_ext.estimate import memory
    from megatron_bridge_ext.testing.tiny_model import TinyGPTShape, tiny_config

    cfg = tiny_config(TinyGPTShape(tp=1, sequence_parallel=False))
    cfg.checkpoint.load = "/nonexistent"
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    with pytest.raises(memory.NotModelled) as refused:
        memory.prepare(cfg, data_parallel_size=1, num_microbatches=1, resume=True)
    assert refused.value.one_line().startswith("resume: ")
    assert not memory.prepare(cfg, data_parallel_size=1, num_microbatches=1).resume
