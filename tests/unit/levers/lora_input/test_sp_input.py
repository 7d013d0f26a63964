"""The fallback log of ``levers/lora_input/sp_input``: each reason once per run, over every PEFT object of it."""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.unit

REASON = "a reason no adapter of this model can take the strategy for"


def _transform_one_ineligible(peft, monkeypatch):
    """Run ``peft.transform`` on one wrapper whose single adapter is decided ineligible for ``REASON``."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    from megatron_bridge_ext.levers.lora_input import sp_input
    from megatron_bridge_ext.levers.lora_input.eligibility import Decision

    wrapper = AdapterWrapper.__new__(AdapterWrapper)  # only its type is read on this path
    monkeypatch.setattr(type(peft), "_bridge_transform", lambda self, module, name, prefix: wrapper)
    monkeypatch.setattr(sp_input, "adapters_of", lambda w: [("adapter", object())])
    monkeypatch.setattr(sp_input, "decide_wrapper",
                        lambda w, strategy, adapters, reason: [Decision("linear_qkv", strategy, "off", REASON)])
    peft.transform(object(), name="linear_qkv", prefix="decoder.layers.0.self_attention")


def test_a_reason_is_logged_once_however_many_pefts_meet_it(ours, monkeypatch, caplog):
    """``mbx demo`` builds one PEFT per variant: the second variant's same fallback is not logged again."""
    from megatron_bridge_ext.levers.lora_input import sp_input

    monkeypatch.setattr(sp_input, "_LOGGED_REASONS", set())
    with caplog.at_level(logging.INFO):
        for strategy in ("shard_local", "regather"):
            _transform_one_ineligible(ours(sequence_parallel_input_strategy=strategy), monkeypatch)
    fallbacks = [r.getMessage() for r in caplog.records if ") not used: " in r.getMessage()]
    assert len(fallbacks) == 1 and REASON in fallbacks[0], fallbacks


def test_a_new_run_logs_the_reason_again(ours, monkeypatch, caplog):
    """A process that runs one training after another (``new_run`` between them) logs a reason once in each."""
    from megatron_bridge_ext.levers.lora_input import sp_input

    monkeypatch.setattr(sp_input, "_LOGGED_REASONS", set())
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            sp_input.new_run()
            _transform_one_ineligible(ours(sequence_parallel_input_strategy="shard_local"), monkeypatch)
    fallbacks = [r.getMessage() for r in caplog.records if ") not used: " in r.getMessage()]
    assert len(fallbacks) == 2 and all(REASON in f for f in fallbacks), fallbacks
