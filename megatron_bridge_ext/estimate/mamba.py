"""Stand-ins for the Mamba kernels of a hybrid model's Mamba layers: what they keep for backward, on fake tensors.

Megatron Core's ``MambaMixer`` (``ssm/mamba_mixer.py``) trains through two kernels of the ``mamba_ssm``
package, which does not install without CUDA (nor does ``causal_conv1d``, whose convolution the first
runs inside): ``mamba_split_conv1d_scan_combined`` (``mamba_ssm/ops/triton/ssd_combined.py``, autograd
function ``MambaSplitConv1dScanCombinedFn``) and the gated RMSNorm after it (``mamba_ssm/ops/triton/
layernorm_gated.py``, ``RMSNorm`` through ``LayerNormFn``; Core's ``ExtendedRMSNorm`` only adds a
sharded state dict). Core imports both under ``try`` and, without them, refuses to build the mixer.

The stand-ins below take their places while the estimate builds and traces a rank's model, and keep
exactly what the kernels keep for backward, read at state-spaces/mamba :data:`SOURCE_COMMIT` (after
v2.3.2.post1; its ``state_dtype`` argument is newer than every release, and changes no saved tensor):

* the fused split-conv-scan (``ssd_combined.py`` forward L824-899, ``ctx.save_for_backward`` L888-889,
  called by Core with no ``rmsnorm_weight`` and no ``outproj_weight``): the projection ``zxbcdt`` it was
  given [b, l, d_in_proj] (the tensor itself), the SSM's ungated output ``out_x`` [b, l, nheads, headdim]
  in the input's dtype (``ssd_chunk_scan.py`` L1278), ``A``, and the ``D`` / ``dt_bias`` / convolution
  tensors it was called with. Its causal convolution, chunk states, ``CB`` and ``dA_cumsum`` live only
  inside the forward (backward recomputes the convolution, L917-921). It returns the gated output
  [b, l, nheads * headdim] in the input's dtype (L855-856);
* the gated RMSNorm (``layernorm_gated.py`` ``LayerNormFn.forward`` L341-366, saves at L360): its input
  as [M, n] (a view of the tensor it was given), the weight, and ``rstd``, fp32 [ngroups * M]
  (``_layer_norm_fwd`` L130), for M rows and ``ngroups = n / group_size``; no ``mean`` (RMS). The fused path
  calls ``self.norm(y)`` (the gate is applied inside the scan): no ``z``; the unfused path passes the gate,
  which it keeps as [M, n] (L353).

With ``use_mamba_mem_eff_path=False`` Core's mixer runs the causal convolution and the chunked scan apart, by the
stand-ins of :mod:`.mamba_unfused`.

They compute nothing (fake tensors only): the saved set depends on shapes and dtypes alone. Everything
else in a Mamba layer (its norm, ``in_proj``, ``out_proj``, the residual) is Megatron Core's own code
and runs as it is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

SOURCE_COMMIT = "e9594ce1c732d97440f0332fdc43170a2294dbfa"
"""The state-spaces/mamba commit the saved sets and the backward allocations were read at."""


def _fake_only(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, FakeTensor):
        raise RuntimeError(f"{what} models a Mamba kernel's saved tensors on fake tensors only; it computes nothing")


class _SplitConvScanSaves(torch.autograd.Function):
    """``MambaSplitConv1dScanCombinedFn`` without ``rmsnorm_weight`` / ``outproj_weight``: saves ``zxbcdt``, the
    convolution weight and bias, ``out_x`` [b, l, nheads, headdim] (input dtype), ``A``, ``D`` and ``dt_bias``."""

    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, headdim):
        _fake_only(zxbcdt, "mamba_split_conv1d_scan_combined's stand-in")
        batch, seqlen, _ = zxbcdt.shape
        nheads = dt_bias.shape[0]
        out_x = zxbcdt.new_empty(batch, seqlen, nheads, headdim)
        out = zxbcdt.new_empty(batch, seqlen, nheads * headdim)
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias)  # None saves nothing
        return out

    @staticmethod
    def backward(ctx, grad_out):
        zxbcdt, weight, bias, _, A, D, dt_bias = ctx.saved_tensors
        grads = [torch.empty_like(t) if t is not None else None for t in (zxbcdt, weight, bias, dt_bias, A, D)]
        return (*grads, None)


def split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                               seq_idx=None, dt_limit=(0.0, float("inf")), return_final_states=False,
                               activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                               outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True, state_dtype=None):
    """``mamba_split_conv1d_scan_combined`` as Megatron Core's training path calls it (``_ssm_training``): D per
    head, no initial states, no fused norm or output projection; anything else is refused by name. ``state_dtype``
    (the inter-chunk states' dtype) changes no saved tensor: it is read by :func:`backward_bytes`."""
    used = [name for name, value in (("initial_states", initial_states), ("seq_idx", seq_idx),
                                     ("rmsnorm_weight", rmsnorm_weight), ("outproj_weight", outproj_weight),
                                     ("return_final_states", return_final_states or None)) if value is not None]
    if used or headdim is None:
        raise NotImplementedError(f"the Mamba scan stand-in models Megatron Core's training call only (D per head, "
                                  f"no {', '.join(used) or 'D per channel'})")
    return _SplitConvScanSaves.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, headdim)


class _GatedRMSNormSaves(torch.autograd.Function):
    """``LayerNormFn`` of an RMS norm: saves the input as [M, n], the weight, fp32 ``rstd`` [ngroups * M] and the
    gate ``z`` as [M, n] when given; returns the input's shape and dtype."""

    @staticmethod
    def forward(ctx, x, weight, z, group_size):
        _fake_only(x, "the gated RMSNorm's stand-in")
        rows = x.reshape(-1, x.shape[-1])
        groups = x.shape[-1] // group_size
        rstd = torch.empty(groups * rows.shape[0], dtype=torch.float32, device=x.device)
        gate = None if z is None else z.reshape(-1, z.shape[-1])
        ctx.save_for_backward(rows, weight, rstd, gate)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad_out):
        rows, weight, _, gate = ctx.saved_tensors
        dz = None if gate is None else grad_out.new_empty(grad_out.shape)
        return grad_out.new_empty(grad_out.shape), torch.empty_like(weight), dz, None


class GatedRMSNorm(torch.nn.Module):
    """Takes the place of ``mamba_ssm``'s gated ``RMSNorm`` (and Core's ``ExtendedRMSNorm``): same constructor,
    a weight of ``hidden_size``; called without ``z`` by the fused path, with it by the unfused one."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps, self.norm_before_gate = eps, norm_before_gate
        self.group_size = group_size or hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        return _GatedRMSNormSaves.apply(x, self.weight, z, self.group_size)


@contextlib.contextmanager
def mamba_kernels() -> Iterator[None]:
    """Megatron Core's Mamba mixer builds and trains with the stand-ins in place of ``mamba_ssm``'s kernels
    (``mamba_mixer.py``: ``HAVE_MAMBA_SSM``, ``ExtendedRMSNorm``, ``mamba_split_conv1d_scan_combined``, the unfused
    path's ``causal_conv1d_fn`` and ``mamba_chunk_scan_combined``, and
    ``MAMBA_HAS_STATE_DTYPE``, as with a ``mamba_ssm`` whose scan takes ``state_dtype``, so that a config's
    ``mamba_training_ssm_states_dtype`` reaches :func:`split_conv1d_scan_combined`), and Core's hybrid stack takes
    the local norm for its final norm (``hybrid_block.py`` builds ``TENorm``, which needs Transformer Engine).
    Everything is put back on exit."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.ssm import mamba_mixer

    from megatron_bridge_ext.estimate import mamba_unfused

    local_norm = LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False)  # reads config.normalization itself
    replaced = {(mamba_mixer, "HAVE_MAMBA_SSM"): True, (mamba_mixer, "ExtendedRMSNorm"): GatedRMSNorm,
                (mamba_mixer, "mamba_split_conv1d_scan_combined"): split_conv1d_scan_combined,
                (mamba_mixer, "causal_conv1d_fn"): mamba_unfused.causal_conv1d_fn,
                (mamba_mixer, "mamba_chunk_scan_combined"): mamba_unfused.chunk_scan_combined,
                (mamba_mixer, "MAMBA_HAS_STATE_DTYPE"): True, (hybrid_block, "TENorm"): local_norm}
    from megatron_bridge_ext.estimate.standins import replaced_attributes

    with replaced_attributes(replaced):
        yield


ASSUMPTION = ("hybrid model: Megatron Core's hybrid stack on the local backend (estimate.build.hybrid_stack_spec); "
              "the Mamba mixers' fused scan and gated RMSNorm are stand-ins that save what mamba_ssm's kernels save "
              f"(estimate.mamba; state-spaces/mamba {SOURCE_COMMIT[:7]}: ssd_combined.py L888-889, "
              "layernorm_gated.py L360), their projections, norms and residuals Core's own; the scan's chunk states, "
              "workspaces and backward as formulas")

EXPAND = 2
"""``MambaMixer``'s ``expand`` (Core's default; the hybrid specs pass none): d_inner = expand x hidden when the config
sets no ``mamba_num_heads``."""
CHUNK_SIZE = 128
"""The scan's chunk size when the provider has no ``mamba_chunk_size`` (Core's ``MambaMixer`` default)."""


@dataclass(frozen=True)
class MambaShapes:
    """One TP rank's Mamba mixer sizes (``MambaMixer.__init__``): heads, head dim, groups, state dim, chunk size."""

    heads: int
    head_dim: int
    groups: int
    state: int
    chunk: int

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv(self) -> int:
        """x, B and C, which the causal convolution runs over."""
        return self.inner + 2 * self.groups * self.state

    @property
    def in_proj(self) -> int:
        """z, x, B, C and dt: ``in_proj``'s output width."""
        return 2 * self.inner + 2 * self.groups * self.state + self.heads


def shapes(provider, tp: Optional[int] = None, cp: Optional[int] = None) -> MambaShapes:
    """The sizes the scan runs with on one of ``tp`` x ``cp`` ranks (the provider's TP and CP by default; 1 and 1:
    the whole layer's). Under CP the scan holds heads / (TP x CP) of the whole sequence, and its groups are split
    over CP when there are at least CP of them per TP rank, else each is repeated to CP / groups ranks, one per
    rank (``mamba_context_parallel.py`` L106-131)."""
    tp = tp or provider.tensor_model_parallel_size
    cp = cp or getattr(provider, "context_parallel_size", None) or 1
    head_dim = provider.mamba_head_dim
    heads = provider.mamba_num_heads or EXPAND * provider.hidden_size // head_dim
    groups = provider.mamba_num_groups // tp
    return MambaShapes(heads // tp // cp, head_dim, max(groups // cp, 1), provider.mamba_state_dim,
                       getattr(provider, "mamba_chunk_size", None) or CHUNK_SIZE)


def layout_checks(provider, tp: int, cp: int) -> list[tuple[bool, str, str]]:
    """What Core's mixer asserts of TP and CP (``mamba_mixer.py`` and ``mamba_context_parallel.py`` L106-131): TP
    divides the heads and the groups; CP the heads per TP rank, and the groups per TP rank or CP divides them;
    each as (failed, setting, message)."""
    m = shapes(provider, tp=1, cp=1)
    heads, groups = m.heads // tp, m.groups // tp
    return [(m.heads % tp, "model.tensor_model_parallel_size", f"TP={tp} does not divide the {m.heads} Mamba heads"),
            (m.groups % tp, "model.tensor_model_parallel_size", f"TP={tp} does not divide the {m.groups} Mamba groups"),
            (heads % cp, "model.context_parallel_size",
             f"CP={cp} does not divide the {heads} Mamba heads of a TP rank"),
            (bool(groups) and (cp % groups if groups < cp else groups % cp), "model.context_parallel_size",
             f"CP={cp} and the {groups} Mamba groups of a TP rank do not divide one another")]


def backward_bytes(m: MambaShapes, *, seq: int, micro_batch: int, element: int, state_element: int) -> int:
    """The Mamba scan's backward allocations beyond what its forward saved, at their peak (``ssd_combined.py``
    ``MambaSplitConv1dScanCombinedFn.backward`` and ``_mamba_chunk_scan_combined_bwd`` at :data:`SOURCE_COMMIT`),
    for sequence l, micro-batch b, c = ceil(l / chunk) chunks of L = chunk, S = b c heads head_dim state:

    * live throughout (``element`` bytes): the gradient of ``zxbcdt`` [b, l, in_proj], the incoming gradient
      [b, l, inner], the recomputed convolution output and its gradient, 2 x [b, l, conv];
    * kept once made: ``dt``'s clone [b, l, heads] and ``dout_x`` [b, l, inner] (``element``), ``dA_cumsum`` and
      ``dt`` 2 x 4 b heads c L, ``CB`` 4 b groups c L L;
    * then the larger of two phases: the state passing's (the fp32 states and their gradient, 2 x 4 S, next to
      ``dstates`` and the converted states, 2 x ``state_element`` S) and the late one (those two, a second
      4 b groups c L L for ``dcb``, four more 4 b heads c L workspaces, ``dB`` and ``dC`` in fp32 before their
      sum, 2 x 4 b l groups state), with the kernels' split count 1 (every head group in one split: b c heads is
      at least the GPU's SMs x heads / groups).
    """
    b, l, L = micro_batch, seq, m.chunk
    padded = -(-l // L) * L
    states = b * (padded // L) * m.heads * m.head_dim * m.state
    live = element * b * l * (m.in_proj + m.inner + 2 * m.conv)
    kept = element * b * l * (m.heads + m.inner) + 8 * b * m.heads * padded + 4 * b * m.groups * padded * L
    passing = 8 * states + 2 * state_element * states
    late = (2 * state_element * states + 4 * b * m.groups * padded * L + 16 * b * m.heads * padded
            + 8 * b * l * m.groups * m.state)
    return live + kept + max(passing, late)


UNFUSED_BACKWARD = ("; the unfused path's scan backward (mamba_chunk_scan_combined) is priced by the fused one's, "
                    "which bounds it: its gradients of x, B, C and dt together are smaller than the gradient of "
                    "zxbcdt and the convolution's two tensors")
"""Said after the scan backward's basis when the mixer runs unfused: ``_mamba_chunk_scan_combined_bwd``
(``ssd_combined.py`` L397-470) makes the same chunk recompute and state phases, with ``dx``, ``dB``, ``dC`` and
``ddt`` [b, l, ...] in place of the fused backward's ``dzxbcdt`` [b, l, in_proj] and the recomputed convolution
with its gradient (2 x [b, l, conv]), and no ``dout_x``; the convolution's backward runs after it."""


CONTEXT_PARALLEL_PARAMETERS = {"conv1d_weight_cp1": "conv1d_weight", "conv1d_bias_cp1": "conv1d_bias",
                               "dt_bias_cp1": "dt_bias", "A_log_cp1": "A_log", "D_cp1": "D"}
"""The mixer's parameters that Core's ``MambaContextParallel`` keeps references to (``mamba_context_parallel.py``,
``__init__``), by its attribute name; its ``get_*`` methods hand them to the scan."""


def rebind_parameters(model: torch.nn.Module) -> None:
    """Point each Mamba mixer's ``MambaContextParallel`` at the mixer's current parameters.

    Megatron's ``Float16Module`` casts parameters in place, so in training the references the context-parallel
    helper took at construction stay the mixer's parameters. The estimate swaps every Parameter object for a fake
    one in the training dtype (:func:`..build._to_fake_device`), which would leave the helper handing the scan the
    parameters as built (``D`` in fp32, counted as a saved activation); this puts the swapped ones in their place.
    """
    from megatron.core.ssm.mamba_mixer import MambaMixer

    for module in model.modules():
        if isinstance(module, MambaMixer):
            for reference, name in CONTEXT_PARALLEL_PARAMETERS.items():
                setattr(module.cp, reference, getattr(module, name))
