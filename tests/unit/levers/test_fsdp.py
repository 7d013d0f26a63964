"""The rules of Megatron-FSDP, one Finding each, and the overrides that turn it on."""

from __future__ import annotations

import types

import pytest

from megatron_bridge_ext.levers import fsdp

pytestmark = [pytest.mark.unit]


def _cfg(ddp=None, dist=None, checkpoint=None, train=None):
    return types.SimpleNamespace(
        ddp=types.SimpleNamespace(**{"use_megatron_fsdp": True,
                                     "data_parallel_sharding_strategy": "optim_grads_params", **(ddp or {})}),
        dist=types.SimpleNamespace(**(dist or {})), checkpoint=types.SimpleNamespace(**(checkpoint or {})),
        train=types.SimpleNamespace(**(train or {})))


def _settings(cfg, model=None, optimizer=None, te="2.17.1"):
    problems, unmodelled = fsdp.findings(cfg, types.SimpleNamespace(**(model or {})),
                                         types.SimpleNamespace(**(optimizer or {})), cfg.ddp, te_version=te)
    return [f.setting for f in problems], [f.setting for f in unmodelled]


def test_a_config_within_the_rules_has_no_finding():
    assert _settings(_cfg()) == ([], [])


@pytest.mark.parametrize("cfg, model, te, setting", [
    (_cfg(ddp={"data_parallel_sharding_strategy": "params"}), None, "2.17.1", "ddp.data_parallel_sharding_strategy"),
    (_cfg(dist={"use_torch_fsdp2": True}), None, "2.17.1", "dist.use_torch_fsdp2"),
    (_cfg(checkpoint={"save": "/ckpt", "ckpt_format": "torch_dist"}), None, "2.17.1", "checkpoint.ckpt_format"),
    (_cfg(train={"check_weight_hash_across_dp_replicas_interval": 10}), None, "2.17.1",
     "train.check_weight_hash_across_dp_replicas_interval"),
    (_cfg(), {"gradient_accumulation_fusion": True}, "2.9.0", "model.gradient_accumulation_fusion"),
    (_cfg(ddp={"fsdp_double_buffer": True}), {"overlap_moe_expert_parallel_comm": True}, "2.17.1",
     "ddp.fsdp_double_buffer"),
])
def test_each_rule_core_or_bridge_enforces_is_one_finding(cfg, model, te, setting):
    assert setting in _settings(cfg, model, te=te)[0]


@pytest.mark.parametrize("cfg, model, optimizer, setting", [
    (_cfg(ddp={"num_distributed_optimizer_instances": 2}), None, None, "ddp.num_distributed_optimizer_instances"),
    (_cfg(ddp={"nccl_ub": True}), None, None, "ddp.fsdp_double_buffer"),
    (_cfg(ddp={"fp8_param_gather": True}), None, None, "ddp.fp8_param_gather"),
    (_cfg(), {"fp8": "hybrid"}, None, "model.fp8"),
])
def test_what_the_estimate_does_not_model_with_fsdp_is_named(cfg, model, optimizer, setting):
    assert setting in _settings(cfg, model, optimizer)[1]


def test_without_fsdp_nothing_is_checked():
    cfg = _cfg(ddp={"data_parallel_sharding_strategy": "params"})
    cfg.ddp.use_megatron_fsdp = False
    assert _settings(cfg) == ([], [])


def test_bridge_turns_the_distributed_optimizer_on_for_both_configs():
    optimizer = types.SimpleNamespace(use_distributed_optimizer=False)
    ddp = types.SimpleNamespace(use_distributed_optimizer=False)
    notes = fsdp.bridge_applies(optimizer, ddp)
    assert optimizer.use_distributed_optimizer and ddp.use_distributed_optimizer and len(notes) == 2
