"""A CPU fake of Megatron Core's ``TELayerNormColumnParallelLinear`` that follows Transformer Engine's
source, under either of TE's two contracts for the returned LayerNorm output.

TE's ``LayerNormLinear`` (``transformer_engine/pytorch/module/layernorm_linear.py``, autograd
function ``_LayerNormLinear``) fuses a LayerNorm (or RMSNorm) in front of a column-parallel GEMM.
Line numbers below are of that file at the named tag of github.com/NVIDIA/TransformerEngine.

What forward returns (v2.3 L211-247, v2.4 L219-263, main L272-318; same in both contracts):
  the norm runs on the local sequence shard x_k [s/t, b, h]. With ``return_layernorm_output``
  the norm output is returned next to the GEMM output. Under sequence parallelism with
  ``return_layernorm_output_gathered`` (TE >= 1.5) the shard is all-gathered once (v2.3 L225,
  v2.4 L233) and that gathered [s, b, h] tensor is both returned and, without FP8, the GEMM's
  input (v2.3 L319, v2.4 L338). Not gathered: the GEMM all-gathers internally and the shard itself
  is returned.

What it saves for backward (v2.3 L333-336 and L390-400, v2.4 L356-358 and L437-447, main L427-435
and L526-536): the local shard ``ln_out`` (never the gathered tensor), dropped only when the weight
is frozen *and* ``return_layernorm_output`` is False. So with Bridge's ``return_layernorm_output=True``
TE keeps the shard even under a frozen (LoRA) base; in the non-gathered mode the returned shard is
that very storage.

How backward treats the grad of the returned norm output (``grad_outputs[1]``):
  * ``te<=2.3`` (v1.5 .. v2.3): gathered mode adds it to the full-sequence dgrad before the
    reduce-scatter (v2.3 L695-696); non-gathered mode adds it to the shard's dgrad after the
    communication (v2.3 L810-813).
  * ``te>=2.4`` (v2.4 .. main; TE commit ce0b46c4d "MXFP8 support in Userbuffers", first in v2.4,
    removed the pre-reduce-scatter add): the reduce-scatter adds nothing (v2.4 L724-732, main
    L900-908) and the only remaining use is the non-gathered add (v2.4 L895-898, main L1132-1135).
    In gathered mode the grad of the returned norm output is dropped.

The weight gradient re-gathers the saved shard (v2.3 L623-645, v2.4 L632-657) only when the
weight trains. Module return layout (v2.4 L1570-1581) through Megatron Core 0.19's wrapper
(``megatron/core/extensions/transformer_engine.py`` L1343-1345): ``((out, ln_out), None)`` with
``return_layernorm_output``, else ``(out, None)``. Core builds TE with ``return_layernorm_output=False``
(L1281); Bridge sets both flags as attributes afterwards, and TE reads them on every call.

Not modelled: FP8 (where the saved shard is a quantised copy), Userbuffers overlap, bias in the
GEMM, delayed wgrad, ``fuse_wgrad_accumulation``. Collectives are plain ``torch.distributed`` calls
on the tensors' own device, so the fake runs on 2 CPU ranks with gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TE_LE_2_3 = "te<=2.3"
TE_GE_2_4 = "te>=2.4"
CONTRACTS = (TE_LE_2_3, TE_GE_2_4)
TE_VERSION = {TE_LE_2_3: "2.3.0", TE_GE_2_4: "2.4.0"}
"""A Transformer Engine version string per contract (the last and the first tag of each)."""


def _all_gather_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((tensor.shape[0] * group.size(), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
    return out


def _reduce_scatter_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((tensor.shape[0] // group.size(), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_tensor(out, tensor.contiguous(), group=group)
    return out


@dataclass(frozen=True)
class _Call:
    """The non-tensor arguments of one forward (TE passes them as extra autograd arguments)."""

    contract: str
    group: object
    sequence_parallel: bool
    return_layernorm_output: bool
    return_layernorm_output_gathered: bool
    normalization: str
    eps: float


def _norm(x2d, gamma, beta, call: _Call):
    if call.normalization == "LayerNorm":
        return F.layer_norm(x2d, (x2d.shape[-1],), gamma, beta, call.eps)
    variance = x2d.float().pow(2).mean(-1, keepdim=True)
    return (x2d.float() * torch.rsqrt(variance + call.eps)).to(x2d.dtype) * gamma


class _LayerNormLinear(torch.autograd.Function):
    """norm -> (all-gather under SP) -> GEMM, with TE's return, save and backward rules of one contract.

    The norm's own backward is autograd's (its saved tensors are the norm's, as TE saves input,
    mu and rsigma); this function saves what TE's ``_LayerNormLinear`` saves around the GEMM.
    """

    @staticmethod
    def forward(ctx, ln_out, weight, call: _Call):
        gathered = call.sequence_parallel and call.return_layernorm_output_gathered
        total = _all_gather_dim0(ln_out, call.group) if call.sequence_parallel else ln_out
        out = total.matmul(weight.t())
        keep = weight.requires_grad or call.return_layernorm_output
        ctx.save_for_backward(ln_out if keep else None, weight)
        ctx.call = call
        if not call.return_layernorm_output:
            return out, None
        return out, (total if gathered else ln_out.view_as(ln_out))

    @staticmethod
    def backward(ctx, grad_out, grad_ln_return):
        ln_out, weight = ctx.saved_tensors
        call = ctx.call
        dgrad = grad_out.matmul(weight)
        gathered = call.sequence_parallel and call.return_layernorm_output_gathered
        if call.sequence_parallel:
            if call.contract == TE_LE_2_3 and gathered and grad_ln_return is not None:
                dgrad = dgrad + grad_ln_return  # v2.3 L695-696; gone from v2.4 on
            dgrad = _reduce_scatter_dim0(dgrad, call.group)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            total = _all_gather_dim0(ln_out, call.group) if call.sequence_parallel else ln_out
            grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        if call.return_layernorm_output and not call.return_layernorm_output_gathered and grad_ln_return is not None:
            dgrad = dgrad + grad_ln_return  # v2.3 L810-813, v2.4 L895-898: every version
        return dgrad, grad_weight, None


class FakeTELayerNormColumnParallelLinear(nn.Module):
    """LayerNorm followed by a column-parallel GEMM under one TE contract (``te_contract``).

    Attributes Bridge reads, as on Megatron Core's module: ``config``, ``tp_group``,
    ``in_features`` and ``out_features`` (per rank), ``sequence_parallel``, ``parallel_mode``
    (``"column"``), ``ub_overlap_ag_fprop`` (False), ``return_layernorm_output`` and
    ``return_layernorm_output_gathered`` (both False until an adapter sets them). Parameters are
    named as TE names them (``layer_norm_weight``, ``layer_norm_bias``, ``weight``) and carry
    Megatron's TP attributes; the norm's are marked ``sequence_parallel`` (their grads are summed
    over the TP group). Weights are drawn from a seeded generator on the full [out, h] matrix and
    sliced per rank, so two instances built with the same seed are identical.
    """

    te_contract_default = TE_GE_2_4

    def __init__(self, input_size: int, output_size: int, *, config, tp_group=None, te_contract: str | None = None,
                 normalization: str | None = None, seed: int | None = None, eps: float | None = None,
                 bias: bool = False, **core_arguments):
        """Also takes the arguments Megatron Core's layer specs pass (``init_method``, ``gather_output``,
        ``skip_bias_add``, ``is_expert``, ``tp_comm_buffer_name``), so it can stand in a layer spec; without
        ``seed`` the weights come from torch's global generator, without ``tp_group`` the TP group is Core's."""
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        if bias:
            raise NotImplementedError("the fake has no GEMM bias (the tiny models use add_bias_linear=False)")
        te_contract = te_contract or self.te_contract_default
        tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        normalization = normalization or getattr(config, "normalization", "LayerNorm")
        eps = eps if eps is not None else getattr(config, "layernorm_epsilon", 1e-5)
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
        if te_contract not in CONTRACTS:
            raise ValueError(f"te_contract={te_contract!r}; use one of {CONTRACTS}")
        tp = tp_group.size()
        if output_size % tp:
            raise ValueError(f"output_size={output_size} is not divisible by the TP size {tp}")
        self.te_contract = te_contract
        self.config = config
        self.tp_group = tp_group
        self.sequence_parallel = bool(config.sequence_parallel) and tp > 1
        self.parallel_mode = "column"
        self.ub_overlap_ag_fprop = False
        self.in_features = input_size
        self.out_features = output_size // tp
        self.normalization = normalization
        self.eps = eps
        self.return_layernorm_output = False
        self.return_layernorm_output_gathered = False

        generator = torch.Generator().manual_seed(seed)
        dtype = config.params_dtype
        full_weight = torch.randn(output_size, input_size, generator=generator).mul_(input_size**-0.5)
        self.weight = nn.Parameter(full_weight.chunk(tp, dim=0)[tp_group.rank()].to(dtype).contiguous())
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        self.layer_norm_weight = nn.Parameter((1.0 + 0.1 * torch.randn(input_size, generator=generator)).to(dtype))
        norms = [self.layer_norm_weight]
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter((0.1 * torch.randn(input_size, generator=generator)).to(dtype))
            norms.append(self.layer_norm_bias)
        else:
            self.layer_norm_bias = None
        for param in norms:
            param.sequence_parallel = self.sequence_parallel

    @classmethod
    def under(cls, contract: str) -> type:
        """A subclass whose instances follow ``contract`` (for layer specs, which take a class)."""
        return type(f"FakeTELayerNormColumnParallelLinear_{contract.replace('<=', 'le').replace('>=', 'ge')}",
                    (cls,), {"te_contract_default": contract})

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The unsharded weights (all-gathered), for a dense reference."""
        return {"weight": _all_gather_dim0(self.weight.detach(), self.tp_group),
                "layer_norm_weight": self.layer_norm_weight.detach(),
                "layer_norm_bias": None if self.layer_norm_bias is None else self.layer_norm_bias.detach()}

    def forward(self, x: torch.Tensor):
        call = _Call(self.te_contract, self.tp_group, self.sequence_parallel, self.return_layernorm_output,
                     self.return_layernorm_output_gathered, self.normalization, self.eps)
        ln_out = _norm(x, self.layer_norm_weight, self.layer_norm_bias, call)
        out, ln_return = _LayerNormLinear.apply(ln_out, self.weight, call)
        return ((out, ln_return) if self.return_layernorm_output else out), None
