"""Gated delta net (Qwen3-Next's and Qwen3.5's linear attention): Megatron Core's ``GatedDeltaNet`` traced on fake
tensors, its flash-linear-attention kernels by stand-ins that keep what the kernels keep.

A model with ``experimental_attention_variant="gated_delta_net"`` marks each layer with ``linear_attention_freq``
(1 a gated-delta-net layer, 0 full attention; Core's ``get_linear_attention_pattern``,
``experimental_attention_variant_module_specs.py`` L402-436). Core's spec (L60-78 there) builds the linear layers'
attention as ``GatedDeltaNet`` with a norm-fused ``in_proj``, an ``out_norm`` over the value head dim and a
row-parallel ``out_proj``; the full-attention layers are Core's ``SelfAttention``, whose output gate
(``attention_output_gate``, which Bridge sets for Qwen3-Next, qwen3_next_bridge.py L81) Core applies itself
(``attention.py`` L1391-1400, L1679-1680). The estimate builds both on the local backend
(:func:`..build.layer_spec`): the linear layer's norm standalone before a plain column-parallel ``in_proj``, as for
every norm-fused linear.

``GatedDeltaNet.forward`` (``ssm/gated_delta_net/gdn.py`` L64-278) runs as it is: projections, splits, the
``_prepare_input_for_gated_delta_rule`` copies, ``g`` and ``beta`` (``common.py`` L382-446), the gated output norm
(L332-380). Core imports three kernels from ``fla`` (``common.py`` L43-54), which needs Triton on a GPU; while a rank's
model is built and traced :func:`kernels` puts stand-ins in their place that save what the kernels save, read at
fla-org/flash-linear-attention v0.4.2 (:data:`SOURCE_COMMIT`; Core pins ``flash-linear-attention~=0.4.0``):

* ``causal_conv1d`` (``fla/modules/conv/causal_conv1d.py`` L11-94, the default ``triton`` backend:
  ``CausalConv1dFunction``, ``fla/modules/conv/triton/ops.py`` L339-378): saves its input ``x`` as given (L364; the
  guard leaves ``x`` as it is, L342: Core's view of ``in_proj``'s output), the weight and the bias (None in Core's
  spec); returns a new contiguous output of ``x``'s shape and dtype (L46, L78);
* ``l2norm`` (``fla/modules/l2norm.py`` ``L2NormFunction`` L237-265, Core's query-key norm): saves its output ``y``
  (L249; ``x``'s shape and dtype, L141, L181) and ``rstd``, fp32 of ``x``'s leading dims (L152, L181);
* ``chunk_gated_delta_rule`` (``fla/ops/gated_delta_rule/chunk.py`` ``ChunkGatedDeltaRuleFunction.forward``
  L219-266, saves at L261): ``q``, ``k``, ``v`` and ``beta`` as given (Core hands them contiguous), the gate's
  chunk-local cumulative sum ``g``, fp32 [B, T, H] (L38; ``fla/ops/utils/cumsum.py`` L266, L436), and ``A``, the
  inverted WY matrix [B, T, H, 64] in ``k``'s dtype (L40-53; ``chunk_scaled_dot_kkt.py`` L113,
  ``solve_tril.py`` L374); no initial state, ``cu_seqlens`` or ``chunk_indices`` in Core's unpacked call, no
  ``q_rstd`` / ``k_rstd`` (Core norms outside the kernel). The chunk states ``h``, ``w``, ``u`` and ``v_new`` live
  only inside the forward: backward recomputes them (L121-143), which :func:`backward_bytes` counts. It returns
  ``o`` of ``v``'s shape in ``q``'s dtype (``chunk_o.py`` L519, ``chunk.py`` L266) and no final state.

The stand-ins compute nothing: their outputs are zeros of the kernels' shapes and dtypes, so Core's module also runs
around them on real CPU tensors (the saved-tensor meter's check of the trace).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_bridge_ext.estimate.standins import replaced_attributes

SOURCE_COMMIT = "ca910f88529565b28b6e16465258f2e239a02dc7"
"""The fla-org/flash-linear-attention commit (tag v0.4.2) the saved sets were read at."""
VARIANT = "gated_delta_net"
CHUNK = 64
"""The chunk size of fla's chunked delta rule (``chunk.py`` L38, ``chunk_scaled_dot_kkt.py`` L81): ``A``'s last dim."""


def used(model) -> bool:
    """A model whose layers Core builds with gated-delta-net linear attention where ``linear_attention_freq`` says."""
    return getattr(model, "experimental_attention_variant", None) == VARIANT and \
        not getattr(model, "multi_latent_attention", False)


def attention_pattern(model) -> list[int]:
    """1 for each gated-delta-net layer, 0 for each full-attention one, as Core reads ``linear_attention_freq`` (an
    int N: every N-th layer full attention; a list: each layer)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern

    return list(get_linear_attention_pattern(model))


def layout_checks(model) -> list[tuple[bool, str, str]]:
    """(failed, setting, message) for each head count of the linear layers that TP x CP does not divide, as Core's
    config refuses it (``transformer_config.py`` L1374-1382)."""
    if not used(model):
        return []
    split = model.tensor_model_parallel_size * (model.context_parallel_size or 1)
    return [(getattr(model, name) % split, "model.tensor_model_parallel_size",
             f"TP x CP = {split} does not divide the {getattr(model, name)} gated-delta-net {what} heads "
             f"(model.{name})")
            for name, what in (("linear_num_key_heads", "key"), ("linear_num_value_heads", "value"))]


class _CausalConv1dSaves(torch.autograd.Function):
    """``CausalConv1dFunction``: saves ``x`` as given, the weight and the bias; returns a contiguous output."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        return torch.zeros_like(x), torch.zeros_like(weight), None if bias is None else torch.zeros_like(bias)


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, **kwargs):
    """fla's ``causal_conv1d`` as Core's training call makes it (``gdn.py`` L214-222): no residual, initial or final
    state, nor packed sequences; anything else is refused by name."""
    given = [name for name, value in (("residual", residual), ("initial_state", initial_state),
                                      ("cu_seqlens", cu_seqlens), ("output_final_state", output_final_state or None))
             if value is not None]
    if given or backend != "triton":
        raise NotImplementedError(f"the causal conv1d stand-in models Core's unpacked training call only (not "
                                  f"{', '.join(given) or 'backend ' + repr(backend)})")
    return _CausalConv1dSaves.apply(x, weight, bias), None


class _L2NormSaves(torch.autograd.Function):
    """``L2NormFunction``: saves its output and fp32 ``rstd`` of the input's leading dims."""

    @staticmethod
    def forward(ctx, x):
        y = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        return torch.zeros_like(grad_out)


def l2norm(x, eps: float = 1e-6, output_dtype=None):
    """fla's ``l2norm`` as Core calls it (``common.py`` L411): the input's dtype."""
    if output_dtype is not None:
        raise NotImplementedError("the l2norm stand-in models Core's call only (no output_dtype)")
    return _L2NormSaves.apply(x)


class _ChunkGatedDeltaRuleSaves(torch.autograd.Function):
    """``ChunkGatedDeltaRuleFunction`` without initial state or packed sequences: saves ``q``, ``k``, ``v``,
    ``beta``, fp32 ``g`` [B, T, H] and ``A`` [B, T, H, 64] in ``k``'s dtype; returns ``o``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        batch, seq, heads = g.shape
        g_cumsum = torch.zeros(batch, seq, heads, dtype=torch.float32, device=g.device)
        inverse = torch.zeros(batch, seq, heads, CHUNK, dtype=k.dtype, device=k.device)
        ctx.save_for_backward(q, k, v, g_cumsum, beta, inverse)
        ctx.g_dtype = g.dtype
        return torch.zeros(v.shape, dtype=q.dtype, device=v.device)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, g, beta, _ = ctx.saved_tensors
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g, dtype=ctx.g_dtype),
                torch.zeros_like(beta))


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """fla's ``chunk_gated_delta_rule`` as Core's training call makes it (``gdn.py`` L242-252): no initial or final
    state, the norm outside the kernel, no packed sequences; anything else is refused by name."""
    given = [name for name, value in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
                                      ("output_final_state", output_final_state or None),
                                      ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel or None))
             if value is not None]
    if given:
        raise NotImplementedError(f"the gated delta rule stand-in models Core's unpacked training call only (not "
                                  f"{', '.join(given)})")
    return _ChunkGatedDeltaRuleSaves.apply(q, k, v, g, beta), None


@contextlib.contextmanager
def kernels() -> Iterator[None]:
    """Core's ``GatedDeltaNet`` builds and trains with the stand-ins in place of fla's kernels (``common.py`` L43-54:
    ``HAVE_FLA``, ``causal_conv1d``, ``l2norm``, ``chunk_gated_delta_rule``; ``gdn.py`` imports the conv and the
    delta rule by name, L17-26). Core 0.18 (Bridge 0.5.1's) has them all in one module,
    ``megatron/core/ssm/gated_delta_net.py`` (its L43-54 import fla's three kernels and set ``HAVE_FLA``; L212-214
    and L439 call them by those names), and the same stand-ins take their places there. Everything is put back on
    exit."""
    import megatron.core.ssm.gated_delta_net as package

    kernels_by_name = {"HAVE_FLA": True, "causal_conv1d": causal_conv1d, "l2norm": l2norm,
                       "chunk_gated_delta_rule": chunk_gated_delta_rule}
    if hasattr(package, "__path__"):
        from megatron.core.ssm.gated_delta_net import common, gdn

        replaced = {(common, name): kernel for name, kernel in kernels_by_name.items()}
        replaced.update({(gdn, "causal_conv1d"): causal_conv1d, (gdn, "chunk_gated_delta_rule"): chunk_gated_delta_rule})
    else:
        replaced = {(package, name): kernel for name, kernel in kernels_by_name.items()}
    with replaced_attributes(replaced):
        yield


def backward_bytes(provider, *, seq: int, micro_batch: int, element: int) -> int:
    """The delta rule's backward allocations at their peak (``chunk.py`` ``chunk_gated_delta_rule_bwd`` L105-216 at
    :data:`SOURCE_COMMIT`), with the incoming gradient of ``o``: every tensor it makes stays referenced until it
    returns, but the local ``dv`` (L145), replaced at L173 before the larger rest is made. For T = b x s tokens
    (all of them, and heads / (TP x CP), after Core's CP all-to-all), H value heads, key dim K, value dim V and
    N = b x ceil(s / 64) chunks, in ``element`` bytes but the fp32 gate gradients:

    * [T, H, K] five times: the recomputed ``w`` (``wy_fast.py`` L260), ``dq``, ``dk``, ``dw`` (``chunk_o.py``
      L680-683), ``dk2`` (``wy_fast.py`` L303);
    * [T, H, V] five times: ``do``, the recomputed ``u`` (``wy_fast.py`` L261) and ``v_new`` (``chunk_delta_h.py``
      L690), ``dv2`` (L749), the returned ``dv`` (``wy_fast.py`` L304);
    * [N, H, K, V] twice: the recomputed chunk states ``h`` (``chunk_delta_h.py`` L687) and their gradient ``dh``
      (L747);
    * ``db`` [T, H] (``wy_fast.py`` L306) and, in fp32, ``dg``, ``dg2`` and ``dg``'s reverse cumulative sum
      (``chunk_o.py`` L682 summed at L715, ``wy_fast.py`` L305, ``chunk.py`` L215).
    """
    cp = getattr(provider, "context_parallel_size", None) or 1
    heads = provider.linear_num_value_heads // (provider.tensor_model_parallel_size * cp)
    tokens = micro_batch * seq * cp
    chunks = micro_batch * -(-seq * cp // CHUNK)
    key, value = provider.linear_key_head_dim, provider.linear_value_head_dim
    per_token = heads * (5 * key + 5 * value + 1)
    return element * (tokens * per_token + 2 * chunks * heads * key * value) + 3 * 4 * tokens * heads


def gdn_attention_spec(provider):
    """Core's gated-delta-net attention spec (``get_gated_delta_net_module_spec``, L60-78) on the local backend: a
    column-parallel ``in_proj`` (the layer's input norm runs before it, standalone), the local norm as ``out_norm``,
    a row-parallel ``out_proj``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = LocalSpecProvider().layer_norm(rms_norm=provider.normalization == "RMSNorm", for_qk=False)
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))


NOTE = (f"gated delta net: Core's GatedDeltaNet traced on the local backend, fla's causal_conv1d, l2norm and "
        f"chunk_gated_delta_rule by stand-ins that save what they save (estimate.features.gated_delta_net; "
        f"fla-org/flash-linear-attention v0.4.2 {SOURCE_COMMIT[:7]}: conv/triton/ops.py L364, l2norm.py L249, "
        "gated_delta_rule/chunk.py L261); the delta rule's backward (its recomputed chunk states and gradients) as "
        "a formula, estimate.features.gated_delta_net.backward_bytes")
