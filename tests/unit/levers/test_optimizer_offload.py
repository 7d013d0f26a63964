"""Optimizer CPU offload's rules, shared by the estimate and the search, and the overrides that set it."""

from __future__ import annotations

import types

import pytest

from megatron_bridge_ext.levers import optimizer_offload as rules
from tests.support.settings import optimizer_config

pytestmark = [pytest.mark.unit]


def _offloaded(share, **fields):
    return optimizer_config(optimizer_cpu_offload=True, optimizer_offload_fraction=share, **fields)


def _settings(optimizer, ddp=None, *, grad_bytes_16=False):
    return [f.setting for f in rules.findings(optimizer, ddp, grad_bytes_16=grad_bytes_16)]


def test_without_the_offload_or_within_its_rules_nothing_is_found():
    assert _settings(optimizer_config(), grad_bytes_16=True) == []
    assert _settings(_offloaded(0.5), grad_bytes_16=True) == []
    assert _settings(_offloaded(0.5, use_precision_aware_optimizer=True)) == []


@pytest.mark.parametrize("fields, ddp, grad_16, setting", [
    ({"decoupled_weight_decay": False}, None, False, "optimizer.decoupled_weight_decay"),
    ({"use_distributed_optimizer": False}, None, False, rules.SETTING),
    ({"use_precision_aware_optimizer": True}, None, True, rules.SETTING),
    ({"optimizer_offload_fraction": 1.5}, None, False, "optimizer.optimizer_offload_fraction"),
    ({}, types.SimpleNamespace(use_megatron_fsdp=True), False, rules.SETTING),
])
def test_each_rule_core_enforces_or_the_estimate_does_not_model_is_one_finding(fields, ddp, grad_16, setting):
    optimizer = _offloaded(fields.pop("optimizer_offload_fraction", 0.5), **fields)
    assert _settings(optimizer, ddp, grad_bytes_16=grad_16) == [setting]


def test_the_search_offloads_adam_on_the_distributed_optimizer_only():
    assert rules.searchable(optimizer_config(), None)
    assert not rules.searchable(optimizer_config(decoupled_weight_decay=False), None)
    assert not rules.searchable(optimizer_config(optimizer="sgd"), None)
    allowed = dict(distributed_optimizer=True, fsdp=None, bf16_moments=False)
    assert rules.search_options(True, **allowed) == [None, 0.5, 1.0]
    assert rules.search_options(False, **allowed) == [None]
    for change in ({"distributed_optimizer": False}, {"fsdp": "optim_grads"}, {"bf16_moments": True}):
        assert rules.search_options(True, **{**allowed, **change}) == [None]


@pytest.mark.parametrize("share, overlap", [(None, False), (0.5, True), (1.0, False)])
def test_overrides_and_apply_set_the_same_fields(share, overlap):
    optimizer = optimizer_config(optimizer_cpu_offload=True, optimizer_offload_fraction=0.25)
    rules.apply(optimizer, share, overlap)
    for line in rules.overrides(share, overlap):
        key, value = line.removeprefix("optimizer.").split("=")
        assert str(getattr(optimizer, key)).lower() == value.lower() or float(getattr(optimizer, key)) == float(value)
    assert rules.given(optimizer) == (share, share is not None and overlap)
