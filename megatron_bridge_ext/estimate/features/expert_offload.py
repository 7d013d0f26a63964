"""Fine-grained offloading of the routed experts' groups (``expert_fc1``, ``moe_act``), traced as Core's TEGroupedMLP.

Core opens those groups only in ``TEGroupedMLP`` (``transformer/moe/experts.py``, "experts.py" below), which the
Transformer Engine spec builds when ``moe_grouped_gemm`` is set (``extensions/transformer_engine_spec_provider.py``
L75-85; without it the TE spec builds ``SequentialMLP``, whose experts open no group; with
``use_transformer_engine_op_fuser`` its forward runs TE's fused op and opens only ``fused_group_mlp``, L753-763). Its
forward (experts.py L793-900) runs on all the local experts' tokens at once:

* ``expert_fc1`` (L792-803): the group around ``linear_fc1``, a TE ``GroupedLinear``; Core has it keep its original
  input for backward (``set_save_original_input``, L278-283, but for MXFP8 and NVFP4), so TE saves the whole input
  [tokens, hidden] as one tensor (TE v2.17.1 ``module/grouped_linear.py`` L623-626, commit 4329ff84) where it would
  otherwise save one view per expert (``torch.split``, L550). The group's ``forced_released_tensors`` is that input;
* ``moe_act`` (L805, L880-900): the group around the activation on fc1's whole output [tokens, 2 x ffn] with the
  routing probabilities [tokens, 1], whatever the activation saves (``weighted_bias_swiglu_impl``: both,
  ``fusions/fused_bias_swiglu.py`` L191-199); under ``moe_act`` recompute the checkpoint's inputs instead
  (L882-886). ``linear_fc2``'s input, saved after the group closes, stays.

Core checks ``min_offloaded_tensor_size`` per tensor (``tensor_need_offloading_checker``,
``fine_grained_activation_offload.py`` L986-1000), so it matters that the tensors are whole: the local spec's
``SequentialMLP`` (what the estimate builds) runs one expert at a time, each saving its own slice. While the trace
records the offload, :func:`grouped` runs SequentialMLP as TEGroupedMLP: Core's own ``TEGroupedMLP.forward`` on the
local experts' weights, its grouped linears :class:`GroupedLinearStandIn` (one GEMM per expert, saving what TE's
``GroupedLinear`` saves in bf16). The groups' pinned host memory is allocated per tensor, not from Core's pool
(``OffloadTensorGroup``, L364-367): the same bytes.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_bridge_ext.findings import ERROR, Finding

GROUPS = ("expert_fc1", "moe_act")
FUSED = "fused_group_mlp"


def _offloaded(model) -> set:
    if not getattr(model, "fine_grained_activation_offloading", False) or not getattr(model, "num_moe_experts", None):
        return set()
    return set(getattr(model, "offload_modules", None) or []) & {*GROUPS, FUSED}


def used(model) -> bool:
    """The experts open Core's groups: ``expert_fc1`` or ``moe_act`` offloaded on experts that open them
    (:func:`groups_open`)."""
    return bool(_offloaded(model) & set(GROUPS)) and groups_open(model)


def groups_open(model) -> bool:
    """An MoE model's experts open ``expert_fc1`` and ``moe_act``: grouped-GEMM experts (``TEGroupedMLP``), not fused
    by Transformer Engine's op fuser (whose forward opens only ``fused_group_mlp``, experts.py L753-763)."""
    return (bool(getattr(model, "num_moe_experts", None)) and bool(getattr(model, "moe_grouped_gemm", False))
            and not getattr(model, "use_transformer_engine_op_fuser", False))


def findings(model) -> list[Finding]:
    """The experts' groups the estimate does not trace: ``fused_group_mlp`` (Transformer Engine's fused grouped MLP
    op, experts.py L617-716, saves inside TE's op fuser) and any expert group under FP8 (the grouped linears' FP8
    padding, ``Fp8Padding``, L767-780, and quantised inputs are TE's)."""
    offloaded = _offloaded(model)
    out = []
    if FUSED in offloaded:
        out.append(Finding("unsupported_model", ERROR, "model.offload_modules",
                           "offloading fused_group_mlp is not modelled by the estimate: the group holds what "
                           "Transformer Engine's fused grouped MLP op saves (moe/experts.py L617-716)",
                           "estimate without fused_group_mlp"))
    experts = sorted(offloaded & set(GROUPS))
    if used(model) and (getattr(model, "fp8", None) or getattr(model, "fp4", None)):
        out.append(Finding("unsupported_model", ERROR, "model.offload_modules",
                           f"offloading {experts} under FP8/FP4 is not modelled by the estimate: Transformer "
                           "Engine's grouped linears then pad and quantise the experts' inputs, and Core has "
                           "linear_fc1 keep its bf16 input for the offload (moe/experts.py L278-283)",
                           f"estimate the bf16 config, or without {experts}"))
    return out


def peft_findings(model, peft) -> list[Finding]:
    """Adapters on the experts' linears (a ``target_modules`` entry naming ``linear_fc1``/``linear_fc2``, the experts
    or a wildcard) with their groups offloaded: the stand-in runs the experts' base weights only, and TE's grouped
    linears with frozen weights save no input (module/grouped_linear.py L636-637), a variant not traced."""
    if peft is None or not used(model):
        return []
    targets = [t for t in getattr(peft, "target_modules", None) or []
               if any(part in t for part in ("linear_fc1", "linear_fc2", "expert", "*"))]
    if not targets:
        return []
    return [Finding("unsupported_model", ERROR, "peft.target_modules",
                    f"adapters on the routed experts' linears ({', '.join(targets)}) with {sorted(_offloaded(model))} "
                    "offloaded are not modelled by the estimate (the experts then run TE's grouped linears on "
                    "frozen weights beside the adapters)",
                    "estimate without the experts' groups in offload_modules, or with adapters off the experts")]


class _GroupedGemm(torch.autograd.Function):
    """One GEMM per expert on its rows of ``inp`` (``params``: the experts' weights, then their biases when
    ``with_bias``); saves for backward what TE's ``_GroupedLinear`` saves in bf16 (module/grouped_linear.py L550,
    L620-653): the whole input under ``save_original_input``, else its per-expert views. The weights and biases are
    parameters (neither the meter nor Core's offload counts them)."""

    @staticmethod
    def forward(ctx, inp, splits, save_original_input, with_bias, *params):
        rows = torch.split(inp, splits)
        weights = params[:len(splits)]
        biases = params[len(splits):] if with_bias else [None] * len(splits)
        ctx.save_for_backward(*((inp,) if save_original_input else rows))
        ctx.splits, ctx.weights, ctx.with_bias = splits, weights, with_bias
        return torch.cat([torch.nn.functional.linear(x, w, b) for x, w, b in zip(rows, weights, biases)])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        rows = torch.split(saved[0], ctx.splits) if len(saved) == 1 else saved
        grads = torch.split(grad, ctx.splits)
        weight_grads = [g.t() @ x for g, x in zip(grads, rows)]
        bias_grads = [g.sum(0) for g in grads] if ctx.with_bias else []
        grad_input = torch.cat([g @ w for g, w in zip(grads, ctx.weights)])
        return grad_input, None, None, None, *weight_grads, *bias_grads


class GroupedLinearStandIn(torch.nn.Module):
    """A TE ``GroupedLinear`` over the local experts' linears (``linears``, not registered: their parameters stay
    SequentialMLP's), called as TEGroupedMLP calls it: ``(input, tokens_per_expert) -> (output, biases)``; with
    ``skip_bias_add`` the biases are returned (``TEGroupedMLP._apply_bias`` adds them), else added in the GEMM."""

    def __init__(self, linears, *, skip_bias_add: bool, save_original_input: bool):
        super().__init__()
        self._linears = list(linears)
        self._skip_bias_add = skip_bias_add
        self._save_original_input = save_original_input

    def forward(self, inp, tokens_per_expert):
        weights = [linear.weight for linear in self._linears]
        biases = [linear.bias for linear in self._linears if getattr(linear, "bias", None) is not None]
        in_gemm = bool(biases) and not self._skip_bias_add
        out = _GroupedGemm.apply(inp, list(tokens_per_expert), self._save_original_input, in_gemm, *weights,
                                 *(biases if in_gemm else []))
        return out, (biases if biases and self._skip_bias_add else None)


class _AsTEGroupedMLP:
    """What ``TEGroupedMLP.forward`` (experts.py L719-900) reads of its module, made from a ``SequentialMLP``: its
    config, its experts' linears as grouped linears, their activation, and the flags of experts.py L253-271."""

    _with_fused_impl = False

    def __init__(self, experts):
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        config = experts.config
        modules = set(config.offload_modules or []) if config.fine_grained_activation_offloading else set()
        self.config = config
        self.offload_expert_fc1 = "expert_fc1" in modules
        self.offload_moe_act = "moe_act" in modules
        self.offload_fused_group_mlp = False
        self.activation_recompute = (config.recompute_granularity == "selective"
                                     and "moe_act" in (config.recompute_modules or []))
        local = experts.local_experts
        self.linear_fc1 = GroupedLinearStandIn([e.linear_fc1 for e in local], skip_bias_add=False,
                                               save_original_input=self.offload_expert_fc1)
        self.linear_fc2 = GroupedLinearStandIn([e.linear_fc2 for e in local], skip_bias_add=True,
                                               save_original_input=False)
        self.activation_func = local[0].activation_func
        self._apply_bias = TEGroupedMLP._apply_bias
        self._remove_glu_interleaving = TEGroupedMLP._remove_glu_interleaving


def _grouped_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    """SequentialMLP's forward as Core's TEGroupedMLP runs it (its own code, on this module's experts)."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    return TEGroupedMLP.forward(_AsTEGroupedMLP(self), permuted_local_hidden_states, tokens_per_expert,
                                permuted_probs)


@contextlib.contextmanager
def grouped(model) -> Iterator[None]:
    """While a microbatch of ``model`` (its config) is traced: SequentialMLP runs as TEGroupedMLP when
    :func:`used`."""
    if not used(model):
        yield
        return
    from unittest import mock

    from megatron.core.transformer.moe.experts import SequentialMLP

    with mock.patch.object(SequentialMLP, "forward", _grouped_forward):
        yield
