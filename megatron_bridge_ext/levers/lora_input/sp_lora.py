"""LoRA-A on a sequence-parallel input without retaining the gathered input.

Notation: tensor-parallel (TP) size t, sequence s, micro-batch b, hidden h, LoRA rank r, tensors
sequence-first. Under sequence parallelism rank k of a column-parallel base layer (``linear_qkv``,
``linear_fc1``) holds only the sequence shard x_k = x[S_k], shape [s/t, b, h]. Megatron Bridge's
LoRA-A (``adapter.linear_in``) is a ColumnParallelLinear(h -> r, gather_output=True) whose weight on
rank k is A_k, shape [r/t, h]. Bridge first all-gathers x to [s, b, h]; autograd then keeps that
gathered tensor for LoRA-A's wgrad, t times the shard per adapted layer, until the backward pass.

Two autograd functions keep only the shard:

* :func:`regather_lora_a` computes exactly what Bridge computes (bitwise, same GEMMs) and gathers x
  again in backward. Cost: one extra all-gather of x per adapted layer and step.
* :func:`shard_local_lora_a` never gathers x: it gathers the tiny A and the rank-r output instead.
  It relies on the grad of its output being replicated across the TP group (see its docstring).

Both honour Megatron Core's wgrad contracts: with ``gradient_accumulation_fusion`` the wgrad is
accumulated into ``weight.main_grad`` and, when the weight carries ``grad_added_to_main_grad``, a
dummy grad is returned and the flag set, as Megatron Core's DDP expects.

Collectives are looked up on ``torch.distributed`` at call time so that wrappers installed there
(communication counters, tracers) see them.
"""

from __future__ import annotations

import difflib
import functools
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed

from megatron_bridge_ext.levers.lora_input import collectives
from megatron_bridge_ext.levers.lora_input.collectives import OFF, REGATHER, SHARD_LOCAL

REGATHER_BUFFER_NAME = "mbx_lora_regather"
"""Name of the gathered-input buffer in Megatron Core's global memory buffer (never retained)."""

# Megatron Core's linear functions record the CUDA autocast state in forward and replay it in backward.
_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")


def _all_gather_tokens_into_buffer(x_local: torch.Tensor, group, async_op: bool):
    """All-gather x_local along dim 0 into the shared buffer: a transient, not an activation."""
    from megatron.core import parallel_state

    shape = list(x_local.shape)
    shape[0] *= group.size()
    total = parallel_state.get_global_memory_buffer().get_tensor(shape, x_local.dtype, REGATHER_BUFFER_NAME)
    handle = torch.distributed.all_gather_into_tensor(total, x_local, group=group, async_op=async_op)
    return total, handle


def _all_gather_dim0_async(tensor: torch.Tensor, group):
    """Start an all-gather of a tensor along dim 0 into a fresh tensor; returns (output, handle)."""
    shape = list(tensor.shape)
    shape[0] *= group.size()
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    handle = torch.distributed.all_gather_into_tensor(out, tensor.contiguous(), group=group, async_op=True)
    return out, handle


def _all_gather_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-gather a tensor along dim 0 into a fresh tensor (it outlives the call)."""
    out, handle = _all_gather_dim0_async(tensor, group)
    handle.wait()
    return out


def _tokens_2d(tensor: torch.Tensor) -> torch.Tensor:
    """[s, b, n] -> [s*b, n], the layout of Megatron Core's wgrad GEMM."""
    return tensor.contiguous().view(-1, tensor.shape[-1])


def _fusion_target(weight: torch.Tensor, gradient_accumulation_fusion: bool) -> Optional[torch.Tensor]:
    """The main_grad to accumulate into, or None for a plain returned wgrad (Megatron Core's rule)."""
    if gradient_accumulation_fusion and hasattr(weight, "main_grad"):
        return weight.main_grad
    return None


@functools.lru_cache(maxsize=1)
def _fused_wgrad_kernels():
    """Apex's ``fused_weight_gradient_mlp_cuda`` (wgrad GEMM accumulated into main_grad), or None."""
    try:
        import fused_weight_gradient_mlp_cuda
    except ImportError:
        return None
    return fused_weight_gradient_mlp_cuda


def _accumulate_wgrad_gemm(main_grad: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    """main_grad += grad_2d^T @ input_2d, with the same kernel Megatron Core's fused path uses.

    Without Apex the product is formed in the inputs' dtype and added in main_grad's dtype: casting
    the [s*b, h] input to main_grad's dtype first would allocate a second gathered input.
    """
    kernels = _fused_wgrad_kernels()
    if kernels is None:
        main_grad.add_(grad_2d.t().matmul(input_2d))
    elif main_grad.dtype == torch.float32:
        kernels.wgrad_gemm_accum_fp32(input_2d, grad_2d, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernels.wgrad_gemm_accum_fp16(input_2d, grad_2d, main_grad)
    else:
        raise RuntimeError(f"gradient accumulation fusion does not support main_grad of dtype {main_grad.dtype}")


def _grad_after_main_grad(
    weight: torch.Tensor, main_grad: torch.Tensor, dtype: torch.dtype
) -> Optional[torch.Tensor]:
    """The weight grad to return once the wgrad went into main_grad (Megatron Core's contract).

    Megatron Core's DDP marks weights with ``grad_added_to_main_grad``; it then expects a dummy grad
    so that its backward hooks run on the main autograd thread, and reads the flag we set.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(main_grad.shape, dtype=dtype, device=main_grad.device, requires_grad=False)


class _RegatherLoRAA(torch.autograd.Function):
    """Column-parallel LoRA-A on the sequence shard, re-gathering the input in backward.

    Forward: all-gather x_local [s/t, b, h] -> [s, b, h] into the global memory buffer
    ``REGATHER_BUFFER_NAME`` (transient), y = total @ weight^T -> [s, b, r/t].
    Saves: x_local and weight only (``ctx.save_for_backward``); main_grad is kept on ctx.
    Backward: all-gather x_local -> [s, b, h] again (async, overlapping the dgrad GEMM
    grad_y @ weight); reduce-scatter(sum) the dgrad [s, b, h] -> [s/t, b, h] (async, overlapping the
    wgrad GEMM grad_y^T @ total -> [r/t, h]).
    The GEMMs have the shapes and order of Bridge's baseline (gather_from_sequence_parallel_region,
    then ColumnParallelLinear without SP), so results are bitwise equal to it.
    Only the grads autograd needs are formed: when x_local needs none (the first layer's input
    under a frozen embedding) neither the dgrad GEMM nor its reduce-scatter runs, as in the
    baseline, whose gather then has no backward; without a weight grad x is not gathered again.
    """

    @staticmethod
    @_custom_fwd
    def forward(ctx, x_local, weight, tp_group, gradient_accumulation_fusion):
        x_local = x_local.contiguous()
        total, _ = _all_gather_tokens_into_buffer(x_local, tp_group, async_op=False)
        ctx.save_for_backward(x_local, weight)
        ctx.tp_group = tp_group
        ctx.main_grad = _fusion_target(weight, gradient_accumulation_fusion)
        return torch.matmul(total, weight.t())

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_y):
        x_local, weight = ctx.saved_tensors
        group, main_grad = ctx.tp_group, ctx.main_grad
        need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_weight = None
        if need_weight:
            total, gather = _all_gather_tokens_into_buffer(x_local, group, async_op=True)
        if need_x:
            grad_total = grad_y.matmul(weight)
        if need_weight:
            gather.wait()
        if need_x:
            grad_x = torch.empty_like(x_local)
            scatter = torch.distributed.reduce_scatter_tensor(grad_x, grad_total, group=group, async_op=True)
        if need_weight:
            grad_2d, total_2d = _tokens_2d(grad_y), _tokens_2d(total)
            if main_grad is None:
                grad_weight = grad_2d.t().matmul(total_2d)
            else:
                _accumulate_wgrad_gemm(main_grad, grad_2d, total_2d)
                grad_weight = _grad_after_main_grad(weight, main_grad, x_local.dtype)
        if need_x:
            scatter.wait()
        return grad_x, grad_weight, None, None


class _ShardLocalLoRAA(torch.autograd.Function):
    """LoRA-A computed on the sequence shard with the whole (tiny) A; no collective on x.

    Forward: all-gather weight A_k [r/t, h] -> A [r, h]; h_k = x_local @ A^T -> [s/t, b, r];
    all-gather h_k along the sequence -> h [s, b, r], complete over the rank dim.
    Saves: x_local and the weight shard A_k (a parameter, no extra memory); main_grad is kept on
    ctx and the weight also by weak reference, to set Megatron Core's DDP flag on the parameter.
    Backward, under the contract that grad_h is replicated over the TP group: all-gather A_k -> A
    again (r*h elements, async, overlapping the wgrad GEMM); grad_h_k = this rank's sequence slice of
    grad_h (no communication); partial wgrad grad_h_k^T @ x_local -> [r, h] over this rank's tokens,
    reduce-scattered(sum) along dim 0 -> [r/t, h] (async, overlapping the dgrad GEMM
    grad_h_k @ A -> [s/t, b, h], which needs no communication).
    The partial wgrad is reduced in at least float32 (main_grad's dtype under fusion).
    Only the grads autograd needs are formed: no A gather and dgrad GEMM when x_local needs no
    grad, no wgrad GEMM and reduce-scatter when the weight needs none.
    """

    @staticmethod
    @_custom_fwd
    def forward(ctx, x_local, weight, tp_group, gradient_accumulation_fusion):
        full_weight = _all_gather_dim0(weight, tp_group)
        h_local = torch.matmul(x_local, full_weight.t())
        ctx.save_for_backward(x_local, weight)
        ctx.tp_group = tp_group
        ctx.main_grad = _fusion_target(weight, gradient_accumulation_fusion)
        ctx.weight_ref = weakref.ref(weight)
        return _all_gather_dim0(h_local, tp_group)

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_h):
        x_local, weight = ctx.saved_tensors
        group, main_grad = ctx.tp_group, ctx.main_grad
        need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = None
        if need_x:
            full_weight, gather = _all_gather_dim0_async(weight, group)
        tokens = x_local.shape[0]
        grad_local = grad_h.narrow(0, group.rank() * tokens, tokens)
        if need_weight:
            partial = _tokens_2d(grad_local).t().matmul(_tokens_2d(x_local))
            reduce_dtype = main_grad.dtype if main_grad is not None else torch.promote_types(partial.dtype, torch.float32)
            partial = partial.to(reduce_dtype).contiguous()
            grad_shard = torch.empty(
                (partial.shape[0] // group.size(), partial.shape[1]), dtype=reduce_dtype, device=partial.device
            )
            scatter = torch.distributed.reduce_scatter_tensor(grad_shard, partial, group=group, async_op=True)
        if need_x:
            gather.wait()
            grad_x = grad_local.matmul(full_weight)
        if not need_weight:
            return grad_x, None, None, None
        scatter.wait()
        if main_grad is None:
            return grad_x, grad_shard.to(weight.dtype), None, None
        main_grad.add_(grad_shard)
        return grad_x, _grad_after_main_grad(ctx.weight_ref(), main_grad, x_local.dtype), None, None


def regather_lora_a(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    tp_group: torch.distributed.ProcessGroup,
    gradient_accumulation_fusion: bool = False,
) -> torch.Tensor:
    """Column-parallel LoRA-A partial output [s, b, r/t] from the sequence shard x_local [s/t, b, h].

    Retains only x_local and weight; the input is all-gathered again in backward. The caller gathers
    the rank dim (``gather_from_tensor_model_parallel_region``), as ColumnParallelLinear's
    ``gather_output`` does. See :class:`_RegatherLoRAA` for saves and collectives.
    """
    return _RegatherLoRAA.apply(x_local, weight, tp_group, gradient_accumulation_fusion)


def shard_local_lora_a(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    tp_group: torch.distributed.ProcessGroup,
    gradient_accumulation_fusion: bool = False,
) -> torch.Tensor:
    """Complete LoRA-A output [s, b, r] from the sequence shard x_local [s/t, b, h]; no collective on x.

    Contract: the grad arriving at the output must be replicated across ``tp_group`` (in Bridge's
    adapter LoRA-B is a ColumnParallelLinear whose input region all-reduces its input grad). Each rank
    back-propagates only its sequence slice of it. The caller must not gather the output again.
    Retains only x_local (and the weight shard, a parameter). See :class:`_ShardLocalLoRAA` for saves and
    collectives.
    """
    return _ShardLocalLoRAA.apply(x_local, weight, tp_group, gradient_accumulation_fusion)


def _regather_output(x_local, weight, tp_group, gradient_accumulation_fusion):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    partial = regather_lora_a(x_local, weight, tp_group, gradient_accumulation_fusion)
    return gather_from_tensor_model_parallel_region(partial, group=tp_group)


@dataclass(frozen=True)
class Strategy:
    """One LoRA-A input strategy: how it computes LoRA-A's complete output from the sequence shard.

    ``output(x_local, weight, tp_group, gradient_accumulation_fusion)`` returns [s, b, r]; the grad
    of the result must be replicated across ``tp_group``, as in Bridge's adapter (LoRA-B's input
    region all-reduces it). ``inside_recompute`` says whether the strategy is worth using for an
    adapter inside a recomputed region (see :mod:`megatron_bridge_ext.levers.lora_input.eligibility`).
    """

    name: str
    output: Callable[..., torch.Tensor]
    retains: str
    inside_recompute: bool

    @property
    def communicates(self) -> str:
        """Its collectives per adapter and microbatch, from the table the plan's cost counts
        (:data:`megatron_bridge_ext.levers.lora_input.collectives.COLLECTIVES`)."""
        return collectives.describe(self.name)


STRATEGIES: dict[str, Strategy] = {
    REGATHER: Strategy(
        REGATHER, _regather_output, retains="the input shard s*b*h/t", inside_recompute=False),
    SHARD_LOCAL: Strategy(
        SHARD_LOCAL, shard_local_lora_a, retains="the input shard s*b*h/t", inside_recompute=True),
}
"""The LoRA-A input strategies under sequence parallelism, by name."""

CHOICES = (OFF, *STRATEGIES)
"""Every accepted value of a strategy setting."""


class ChoiceError(ValueError):
    """A strategy setting holds an unknown value; ``setting``, ``value``, ``choices`` and ``suggestion``
    let a caller (the config checks of ``mbx plan``) name them in its own words."""

    def __init__(self, setting: str, value, choices: tuple, suggestion: Optional[str]):
        self.setting, self.value, self.choices, self.suggestion = setting, value, choices, suggestion
        super().__init__(f"{setting}={value!r} is not valid. Fix: {self.fix()}")

    def fix(self) -> str:
        allowed = ", ".join(repr(c) for c in self.choices)
        return f"use one of {allowed}" + (f" (did you mean {self.suggestion!r}?)" if self.suggestion else "")


def check_choice(value, setting: str, *, allow_none: bool = False) -> None:
    """Refuse anything but one of :data:`CHOICES` (or None where the setting allows it), naming ``setting``,
    the valid values and the closest one (a typo is the usual cause)."""
    if value is None and allow_none:
        return
    if not isinstance(value, str) or value not in CHOICES:
        close = difflib.get_close_matches(str(value), CHOICES, n=1)
        raise ChoiceError(setting, value, CHOICES + ((None,) if allow_none else ()), close[0] if close else None)


def lora_a_output(
    strategy: str,
    x_local: torch.Tensor,
    weight: torch.Tensor,
    tp_group: torch.distributed.ProcessGroup,
    gradient_accumulation_fusion: bool = False,
) -> torch.Tensor:
    """LoRA-A's complete output [s, b, r] from the sequence shard, by one of :data:`STRATEGIES`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown LoRA-A strategy {strategy!r}; expected one of {tuple(STRATEGIES)}")
    return STRATEGIES[strategy].output(x_local, weight, tp_group, gradient_accumulation_fusion)
