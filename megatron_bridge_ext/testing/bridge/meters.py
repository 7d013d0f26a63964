"""What is measured inside Megatron Bridge's training loop, through Bridge's own extension points only.

* :class:`StepRecorder`: Bridge callbacks (``on_train_step_start``/``on_train_step_end``) record
  each iteration's loss (``lm loss`` as Bridge reduces it), the grad norm the optimizer returned,
  the rank's environment for the variables of ``cfg.env_vars``, and the counts of a
  :class:`~megatron_bridge_ext.measure.RecomputeProbe` held over the whole step.
* :class:`MeteredForwardStep`: Bridge's ``forward_step`` with a
  :class:`~megatron_bridge_ext.measure.SavedActivationMeter` around each micro-batch's forward
  (the model forward runs inside ``forward_step``; Core's schedule runs backward afterwards).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional


@dataclasses.dataclass
class Step:
    """One training iteration as this rank saw it."""

    iteration: int
    loss: float
    grad_norm: Optional[float]
    environment: dict[str, Optional[str]]  # os.environ[name] for every name of cfg.env_vars
    recompute: dict[str, int]  # RecomputeProbe counts over the whole step (forward and backward)
    dtypes: list[str]  # of the model's parameters
    gradients: Optional[dict] = None  # trainable parameter -> this rank's gradient (float64 copy), when kept


class StepRecorder:
    """Bridge callbacks that record each iteration (see :class:`Step`).

    ``keep_gradients``: also copy each trainable parameter's gradient as the optimizer used it
    (Megatron Core's ``main_grad``, reduced over the tensor-parallel group where needed).
    """

    def __init__(self, *, keep_gradients: bool = False) -> None:
        self.steps: list[Step] = []
        self._keep_gradients = keep_gradients
        self._probe = None

    def callbacks(self):
        from megatron.bridge.training.callbacks import CallbackManager

        manager = CallbackManager()
        manager.register("on_train_step_start", self._start)
        manager.register("on_train_step_end", self._end)
        return manager

    def _start(self, context) -> None:
        from megatron_bridge_ext.levers.recompute.probe import RecomputeProbe

        self._probe = RecomputeProbe(context.model[0])
        self._probe.__enter__()

    def close(self) -> None:
        """Remove the probe of a step that did not end (the run failed inside it)."""
        if self._probe is not None:
            self._probe.__exit__(None, None, None)
            self._probe = None

    def _end(self, context) -> None:
        recompute = self._probe.as_dict()
        self.close()
        env_vars = getattr(context.state.cfg, "env_vars", None) or {}
        model = context.model[0]
        self.steps.append(Step(
            iteration=context.state.train_state.step + 1,  # Bridge counts the step after this event
            loss=float(context.loss_dict["lm loss"]),
            grad_norm=None if context.grad_norm is None else float(context.grad_norm),
            environment={name: os.environ.get(name) for name in env_vars},
            recompute=recompute,
            dtypes=sorted({str(p.dtype) for p in model.parameters()}),
            gradients={name: getattr(p, "main_grad", p.grad).detach().double().clone()
                       for name, p in model.named_parameters() if p.requires_grad} if self._keep_gradients else None,
        ))


class MeteredForwardStep:
    """Bridge's ``forward_step`` with a SavedActivationMeter around each micro-batch's forward.

    Bridge hands a functor the GlobalState when its first parameter is named ``state``.
    """

    def __init__(self, forward_step) -> None:
        self._forward_step = forward_step
        self.saved: list = []  # SavedActivations, one per micro-batch forward

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False):
        from megatron_bridge_ext.measure import SavedActivationMeter

        with SavedActivationMeter(model) as meter:
            output = self._forward_step(state, data_iterator, model, return_schedule_plan)
        self.saved.append(meter.result())
        return output
