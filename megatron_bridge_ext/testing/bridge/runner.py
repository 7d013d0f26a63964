"""One call of Megatron Bridge's real entry point, ``pretrain`` or ``finetune`` with ``gpt_step.forward_step``.

Bridge's setup, DDP, optimizer, PEFT hooks and torch_dist checkpoints run as they are; the run is observed
through :mod:`.meters` only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_bridge_ext.testing.bridge.meters import MeteredForwardStep, Step, StepRecorder


@dataclasses.dataclass
class Run:
    """What one pretrain/finetune call recorded on this rank."""

    steps: list[Step]
    saved: list  # SavedActivations per micro-batch forward; empty when not metered

    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    def grad_norms(self) -> list[Optional[float]]:
        return [s.grad_norm for s in self.steps]


def run(entry: str, cfg, *, meter: bool = False, keep_gradients: bool = False) -> Run:
    """Call Bridge's ``pretrain`` or ``finetune`` (``entry``) on ``cfg`` with ``gpt_step.forward_step``."""
    from megatron.bridge.training.gpt_step import forward_step

    if entry == "pretrain":
        from megatron.bridge.training.pretrain import pretrain as bridge_entry
    else:
        from megatron.bridge.training.finetune import finetune as bridge_entry
    recorder = StepRecorder(keep_gradients=keep_gradients)
    step = MeteredForwardStep(forward_step) if meter else forward_step
    try:
        bridge_entry(cfg, step, callbacks=recorder.callbacks())
    finally:
        recorder.close()
    return Run(recorder.steps, step.saved if meter else [])
