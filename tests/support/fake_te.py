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

FP8 (``fp8=True``; the module's ``fp8`` as TE sets it under ``fp8_autocast``): the norm runs in high
precision whenever the norm output is returned (``with_quantized_norm`` is off, v2.3 L190-195, v2.4
L194-200) and the *returned* norm output stays unquantised in both modes (v2.3 L211-213 and L225-226,
v2.4 L218-221 and L233-234, main@d0067d0da L271-287). What TE saves is the shard after the input
quantiser (gathered mode v2.3 L228, v2.4 L237, main L290; non-gathered v2.3 L234, v2.4 L245, main
L299), i.e. a quantised *copy* of its own storage: an adapter that keeps the returned shard does not
share it. The fake's quantiser is exact (a copy in new storage, same values), so the gradient paths are
compared with the float64 reference and FP8 rounding is not modelled; the GEMM takes the quantised
gathered copy (v2.4 L239), which for an exact quantiser is the same function.

Userbuffers (``ub_overlap_rs_dgrad``, ``ub_bulk_wgrad``; the module attributes TE derives from its
constructor arguments, v2.3 L1098-1106, v2.4 L1183-1191; the fake's collectives stand in for the
Userbuffers ones):
  * ``ub_overlap_rs_dgrad``: the dgrad GEMM reduce-scatters (v2.3 L690-691, v2.4 L720-721); under
    ``te<=2.3`` the gathered-output add in the other branch (v2.3 L692-696) is skipped, so the grad of
    a gathered returned norm output is dropped there too;
  * ``ub_bulk_wgrad``: the reduce-scatter of dgrad runs inside the wgrad GEMM (v2.3 L792-796, v2.4
    L873-877), only for a trainable weight (v2.3 L708, v2.4 L748); the gathered add is skipped as above.
    With a frozen weight nothing reduces dgrad: ``te<=2.3`` fails on the full buffer's view (v2.3 L811),
    ``te>=2.4`` takes its local chunk unreduced (v2.4 L722-723).
The non-gathered add (v2.3 L810-813, v2.4 L895-898) comes after all of these, in every mode.

Not modelled: FP8 rounding and scaling, Userbuffers ``ub_bulk_dgrad`` (it only moves the wgrad input's
all-gather), bias in the GEMM, delayed wgrad, ``fuse_wgrad_accumulation``. Collectives are plain
``torch.distributed`` calls on the tensors' own device, so the fake runs on 2 CPU ranks with gloo.
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
    fp8: bool = False
    ub_overlap_rs_dgrad: bool = False
    ub_bulk_wgrad: bool = False


def _quantised_copy(tensor: torch.Tensor) -> torch.Tensor:
    """TE's input quantiser, exact: a copy in new storage (what TE saves under FP8), same values."""
    return tensor.clone()


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
        returned = total if gathered else ln_out.view_as(ln_out)  # unquantised under FP8 too
        saved = _quantised_copy(ln_out) if call.fp8 else ln_out
        out = total.matmul(weight.t())
        keep = weight.requires_grad or call.return_layernorm_output
        ctx.save_for_backward(saved if keep else None, weight)
        ctx.call, ctx.shard_shape = call, ln_out.shape
        if not call.return_layernorm_output:
            return out, None
        return out, returned

    @staticmethod
    def backward(ctx, grad_out, grad_ln_return):
        ln_out, weight = ctx.saved_tensors
        call = ctx.call
        dgrad = grad_out.matmul(weight)
        gathered = call.sequence_parallel and call.return_layernorm_output_gathered
        if call.sequence_parallel:
            dgrad = _scatter_dgrad(dgrad, grad_ln_return if gathered else None, ctx.needs_input_grad[1], call)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            total = _all_gather_dim0(ln_out, call.group) if call.sequence_parallel else ln_out
            grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        dgrad = dgrad.view(ctx.shard_shape)  # v2.3 L811, v2.4 L896
        if call.return_layernorm_output and not call.return_layernorm_output_gathered and grad_ln_return is not None:
            dgrad = dgrad + grad_ln_return  # v2.3 L810-813, v2.4 L895-898: every version, Userbuffers or not
        return dgrad, grad_weight, None


def _scatter_dgrad(dgrad, grad_gathered_return, trains_weight: bool, call: _Call):
    """The full-sequence dgrad to this rank's shard, as TE's backward branches do; ``grad_gathered_return`` is the
    grad of a gathered returned norm output (None in the non-gathered mode)."""
    if call.ub_overlap_rs_dgrad:  # v2.3 L690-691, v2.4 L720-721: the add of L695-696 is in the branch not taken
        return _reduce_scatter_dim0(dgrad, call.group)
    if call.ub_bulk_wgrad:  # v2.3 L792-796 and v2.4 L873-877, inside `if ctx.requires_wgrad` (v2.3 L708, v2.4 L748)
        if trains_weight:
            return _reduce_scatter_dim0(dgrad, call.group)
        if call.contract == TE_LE_2_3:
            return dgrad  # unreduced full buffer: the view at v2.3 L811 fails
        return dgrad.chunk(call.group.size(), dim=0)[call.group.rank()]  # v2.4 L722-723: local chunk, unreduced
    if call.contract == TE_LE_2_3 and grad_gathered_return is not None:
        dgrad = dgrad + grad_gathered_return  # v2.3 L695-696; gone from v2.4 on
    return _reduce_scatter_dim0(dgrad, call.group)


class FakeTELayerNormColumnParallelLinear(nn.Module):
    """LayerNorm followed by a column-parallel GEMM under one TE contract (``te_contract``).

    Attributes Bridge reads, as on Megatron Core's module: ``config``, ``tp_group``,
    ``in_features`` and ``out_features`` (per rank), ``sequence_parallel``, ``parallel_mode``
    (``"column"``), ``ub_overlap_ag_fprop`` (False), ``return_layernorm_output`` and
    ``return_layernorm_output_gathered`` (both False until an adapter sets them). ``fp8``,
    ``ub_overlap_rs_dgrad`` and ``ub_bulk_wgrad`` (constructor arguments, False by default; the
    Userbuffers ones only under sequence parallelism, as TE derives them) select the modes in the
    module docstring. Parameters are
    named as TE names them (``layer_norm_weight``, ``layer_norm_bias``, ``weight``) and carry
    Megatron's TP attributes; the norm's are marked ``sequence_parallel`` (their grads are summed
    over the TP group). Weights are drawn from a seeded generator on the full [out, h] matrix and
    sliced per rank, so two instances built with the same seed are identical.
    """

    te_contract_default = TE_GE_2_4

    def __init__(self, input_size: int, output_size: int, *, config, tp_group=None, te_contract: str | None = None,
                 normalization: str | None = None, seed: int | None = None, eps: float | None = None,
                 bias: bool = False, fp8: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, **core_arguments):
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
        self.fp8 = fp8
        self.ub_overlap_rs_dgrad = ub_overlap_rs_dgrad and self.sequence_parallel
        self.ub_bulk_wgrad = ub_bulk_wgrad and self.sequence_parallel and not self.ub_overlap_rs_dgrad
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
                     self.return_layernorm_output_gathered, self.normalization, self.eps, self.fp8,
                     self.ub_overlap_rs_dgrad, self.ub_bulk_wgrad)
        ln_out = _norm(x, self.layer_norm_weight, self.layer_norm_bias, call)
        out, ln_return = _LayerNormLinear.apply(ln_out, self.weight, call)
        return ((out, ln_return) if self.return_layernorm_output else out), None


def see_fake_te(contract: str, setattr_=setattr) -> None:
    """Bridge sees the fake as TE's LayerNorm-linear, and the contract's TE version as installed.

    ``setattr_`` is pytest's ``monkeypatch.setattr`` in a test (undone after it), plain ``setattr`` in a
    process of its own.
    """
    from packaging.version import Version

    from megatron_bridge_ext import versions
    from megatron_bridge_ext.patches import bridge_peft_without_te, bridge_truthful_te_detection

    bridge_peft_without_te.import_bridge_peft()
    bridge_truthful_te_detection.PATCH.apply()  # before the flags below, which it would reset
    from megatron.bridge.peft import utils as peft_utils

    te_version = TE_VERSION[contract]
    real_installed, real_metadata = versions.installed_version, peft_utils.version

    class _NoSuchLayer:
        pass

    setattr_(versions, "installed_version",
             lambda name: Version(te_version) if name == "transformer-engine" else real_installed(name))
    setattr_(peft_utils, "version", lambda name: te_version if name == "transformer-engine" else real_metadata(name))
    setattr_(peft_utils, "HAVE_TE", True)
    setattr_(peft_utils, "TELayerNormColumnParallelLinear", FakeTELayerNormColumnParallelLinear)
    setattr_(peft_utils, "TECL", (FakeTELayerNormColumnParallelLinear,))
    setattr_(peft_utils, "TERL", ())
    setattr_(peft_utils, "TELinear", _NoSuchLayer)
