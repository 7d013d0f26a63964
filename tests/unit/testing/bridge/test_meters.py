"""The Bridge-loop recorder leaves Megatron Core's attention as it found it, also when a run fails mid-step
(Bridge then never fires ``on_train_step_end``, and :func:`megatron_bridge_ext.testing.bridge.runner.run` closes the recorder itself)."""

import types

import pytest
import torch

from megatron_bridge_ext.levers.recompute.probe import RecomputeProbe
from megatron_bridge_ext.testing.bridge.meters import StepRecorder

pytestmark = pytest.mark.unit

NAME = "_checkpointed_attention_forward"


def test_closing_a_recorder_after_a_step_that_never_ended_removes_its_probe():
    from megatron.core.transformer.attention import Attention

    original = Attention.__dict__.get(NAME)
    recorder = StepRecorder()
    recorder._start(types.SimpleNamespace(model=[torch.nn.Linear(2, 2)]))  # Bridge's on_train_step_start
    wrapped = Attention.__dict__.get(NAME)
    recorder.close()
    recorder.close()  # a second close (the normal end already closed it) changes nothing
    assert wrapped is not original  # the step's probe was counting
    assert Attention.__dict__.get(NAME) is original
    assert RecomputeProbe._active == []
