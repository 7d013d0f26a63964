"""Stand-ins for the kernels of the Mamba mixer's unfused path (``use_mamba_mem_eff_path=False``), on fake tensors.

Core's ``MambaMixer._ssm_prefill`` (``ssm/mamba_mixer.py`` L783-1094), which training takes when the config turns
the fused scan off (``forward`` L502-508), runs three kernels where the fused path runs one: ``causal_conv1d_fn``
over x, B and C transposed to [b, conv, l] (L904-923), ``mamba_chunk_scan_combined`` on x, dt, B and C each made
contiguous (L937-941, L1063-1080), and the gated RMSNorm with ``z`` (L1090-1093, the stand-in in :mod:`.mamba`).
Each stand-in keeps exactly what its kernel keeps for backward:

* ``causal_conv1d_fn`` (Dao-AILab/causal-conv1d :data:`CONV_SOURCE` v1.6.1.post4, ``causal_conv1d/
  causal_conv1d_interface.py`` ``CausalConv1dFn.forward`` L11-64, ``ctx.save_for_backward`` L59): the input x it
  was given [b, dim, l] (copied only when neither its length nor its channels are contiguous, L24-25), the weight,
  the bias, and no ``seq_idx`` or initial states (Core passes none in training). It returns [b, dim, l] in the
  input's dtype (``cpp_functions.py`` L103: ``torch.empty_like(x)``);
* ``mamba_chunk_scan_combined`` (state-spaces/mamba :data:`.mamba.SOURCE_COMMIT`, ``mamba_ssm/ops/triton/
  ssd_combined.py`` ``MambaChunkScanCombinedFn.forward`` L599-617, ``ctx.save_for_backward`` L606): the output
  ``out`` [b, l, nheads, headdim] in x's dtype (``ssd_chunk_scan.py`` L1276; ``out_x`` instead when ``z`` is
  given, L1277-1278), the x, dt, A, B, C, D, z and ``dt_bias`` it was called with, and ``dA_cumsum``, fp32
  [b, nheads, ceil(l / chunk), chunk] (``ssd_chunk_state.py`` ``_chunk_cumsum_fwd`` L723-725). Its chunk states
  and ``CB`` live only inside the forward (the backward recomputes them, ``ssd_combined.py`` L440-448).
"""

from __future__ import annotations

import math

import torch

from megatron_bridge_ext.estimate.mamba import _fake_only

CONV_SOURCE = "9e4ace0b1d53ede275308abf25f64a1fc04c5fd4"
"""The Dao-AILab/causal-conv1d commit (tag v1.6.1.post4) the convolution's saved set was read at."""


class _CausalConv1dSaves(torch.autograd.Function):
    """``CausalConv1dFn`` without ``seq_idx`` or initial states: saves x (contiguous along length or channels), the
    weight and the bias; returns x's shape and dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        _fake_only(x, "causal_conv1d_fn's stand-in")
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        ctx.save_for_backward(x, weight, bias)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None if bias is None else torch.empty_like(bias)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """``causal_conv1d_fn`` as Core's unfused training path calls it (no ``seq_idx``, no states); anything else is
    refused by name."""
    used = [name for name, value in (("seq_idx", seq_idx), ("initial_states", initial_states),
                                     ("return_final_states", return_final_states or None)) if value is not None]
    if used:
        raise NotImplementedError(f"the causal convolution stand-in models Megatron Core's training call only "
                                  f"(no {', '.join(used)})")
    return _CausalConv1dSaves.apply(x, weight, bias)


class _ChunkScanSaves(torch.autograd.Function):
    """``MambaChunkScanCombinedFn`` without states, ``seq_idx`` or varlen: saves ``out`` (``out_x`` with z), x, dt,
    fp32 ``dA_cumsum`` [b, nheads, chunks, chunk], A, B, C, D, z and ``dt_bias``; returns ``out``."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, D, z, dt_bias):
        _fake_only(x, "mamba_chunk_scan_combined's stand-in")
        batch, seqlen, nheads, _ = x.shape
        chunks = math.ceil(seqlen / chunk_size)
        dA_cumsum = torch.empty(batch, nheads, chunks, chunk_size, dtype=torch.float32, device=x.device)
        out = x.new_empty(x.shape)
        out_x = x.new_empty(x.shape) if z is not None else None
        ctx.save_for_backward(out if z is None else out_x, x, dt, dA_cumsum, A, B, C, D, z, dt_bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _, x, dt, _, A, B, C, D, z, dt_bias = ctx.saved_tensors
        grads = [None if t is None else torch.empty_like(t) for t in (x, dt, A, B, C)]
        rest = [None if t is None else torch.empty_like(t) for t in (D, z, dt_bias)]
        return (*grads, None, *rest)


def chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                        cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
                        return_varlen_states=False, state_dtype=None):
    """``mamba_chunk_scan_combined`` as Core's unfused training path calls it (no initial or final states, no
    ``seq_idx``); anything else is refused by name. ``state_dtype`` changes no saved tensor."""
    used = [name for name, value in (("initial_states", initial_states), ("seq_idx", seq_idx),
                                     ("return_final_states", return_final_states or None),
                                     ("return_varlen_states", return_varlen_states or None)) if value is not None]
    if used:
        raise NotImplementedError(f"the chunked scan stand-in models Megatron Core's training call only "
                                  f"(no {', '.join(used)})")
    return _ChunkScanSaves.apply(x, dt, A, B, C, chunk_size, D, z, dt_bias)
