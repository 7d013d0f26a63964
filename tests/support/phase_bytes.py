"""Bytes of the optimizer's state, its fp32 main copies and the gradient buffer, counted inside Bridge's loop.

A Bridge callback at the first ``on_train_step_start`` wraps the optimizer's ``step`` on the instance: Bridge's
``train_step`` calls ``optimizer.step()`` right after ``forward_backward_func`` (megatron/bridge/training/train.py
L915-939), so the wrapper counts once after each iteration's backward and once after its step; the
``on_train_step_end`` callback counts again once the iteration is over. What is counted, as
``numel() * element_size()`` of the tensors themselves:

* moments: ``exp_avg`` and ``exp_avg_sq`` in the state of each torch optimizer behind Core's wrapper (created in
  the first ``step()``: torch optim/adam.py ``_init_group``, ``if len(state) == 0``);
* main copies: the distributed optimizer's ``shard_fp32_from_float16_groups`` (distrib_optimizer.py L375-445:
  ``shard_model_param.clone().float()`` for 16-bit parameters; fp32 parameters go to ``shard_fp32_groups`` as
  views of the model's own parameters, no extra bytes);
* gradients: each parameter's ``main_grad`` (its view into DDP's ``grad_data``), and apart from them the
  padding of the buffers (``grad_data`` elements beyond their parameters' views: the distributed optimizer pads
  each parameter's start and each bucket's end: optimizer/param_layout.py L24-36, ``pad_param_start`` and
  ``pad_bucket_end``), which the estimate does not model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Iterator

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Count:
    """One count: where in the loop it was taken, and its bytes."""

    iteration: int
    point: str  # "after backward", "after step", "after iteration"
    moments: int
    masters: int
    gradients: int
    padding: int


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers behind Core's wrapper (a ChainedOptimizer holds several)."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [inner.optimizer for inner in chained]


def _wrappers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def moment_bytes(optimizer) -> int:
    return _nbytes(state[name] for torch_opt in _torch_optimizers(optimizer)
                   for state in torch_opt.state.values() for name in MOMENTS if name in state)


def master_bytes(optimizer) -> int:
    return _nbytes(p for wrapper in _wrappers(optimizer)
                   for group in getattr(wrapper, "shard_fp32_from_float16_groups", []) for p in group)


def gradient_bytes(model_chunks) -> tuple[int, int]:
    """(bytes of the parameters' ``main_grad`` views, bytes of the buffers' padding) over DDP's buffers."""
    views = padding = 0
    for chunk in model_chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            mine = _nbytes(p.main_grad for p in buffer.params)
            views += mine
            padding += _nbytes([buffer.grad_data]) - mine
    return views, padding


class PhaseCounter:
    """Bridge callbacks that take a :class:`Count` after each backward, step and iteration."""

    def __init__(self) -> None:
        self.counts: list[Count] = []
        self._iteration = 0

    def callbacks(self):
        from megatron.bridge.training.callbacks import CallbackManager

        manager = CallbackManager()
        manager.register("on_train_step_start", self._start)
        manager.register("on_train_step_end", self._end)
        return manager

    def _take(self, point: str, optimizer, model) -> None:
        gradients, padding = gradient_bytes(model)
        self.counts.append(Count(self._iteration, point, moment_bytes(optimizer), master_bytes(optimizer),
                                 gradients, padding))

    def _start(self, context) -> None:
        self._iteration = context.state.train_state.step + 1
        optimizer, model = context.optimizer, context.model
        if getattr(optimizer, "_phase_counted", False):
            return
        step = optimizer.step

        @functools.wraps(step)
        def counted_step(*args, **kwargs):
            self._take("after backward", optimizer, model)
            result = step(*args, **kwargs)
            self._take("after step", optimizer, model)
            return result

        optimizer.step, optimizer._phase_counted = counted_step, True

    def _end(self, context) -> None:
        self._take("after iteration", context.optimizer, context.model)


@contextlib.contextmanager
def cpu_tensors_typed_as_cuda() -> Iterator[None]:
    """``Tensor.type()`` without arguments names a CPU tensor as its CUDA type while held.

    Megatron Core's distributed optimizer sorts parameters by that name (distrib_optimizer.py L466
    ``model_param.type() == 'torch.cuda.FloatTensor'``, and the ``torch.cuda.HalfTensor``/``BFloat16Tensor``
    branch above it) and refuses any other with a TypeError, so on CPU ranks it refuses every parameter; the
    name is what a GPU rank's tensor of the same dtype reports. A call with a dtype (a cast) is torch's own.
    """
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or name.startswith("torch.cuda."):  # a cast, or named already (torch-function modes re-enter)
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def counted_pretrain(cfg) -> list[Count]:
    """Bridge's ``pretrain`` on ``cfg`` with ``gpt_step.forward_step``, counted by a :class:`PhaseCounter`."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    counter = PhaseCounter()
    with cpu_tensors_typed_as_cuda():
        pretrain(cfg, forward_step, callbacks=counter.callbacks())
    return counter.counts
