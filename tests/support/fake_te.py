"""A CPU fake of Transformer Engine's LayerNorm + column-parallel linear, for LoRA tests.

Megatron Core's ``TELayerNormColumnParallelLinear`` (TE's ``LayerNormLinear``) fuses the
LayerNorm in front of a column-parallel GEMM. Under sequence parallelism (SP) it receives the
local sequence shard x_k [s/t, b, h], normalises it, all-gathers the normalised tokens to
[s, b, h] for the GEMM and keeps only the shard for backward. Two attributes control what it
hands to a LoRA adapter:

* ``return_layernorm_output``: return the LayerNorm output next to the GEMM output, as
  ``((out, ln_out), bias)`` through Megatron Core's wrapper (Bridge's ``base_linear_forward``
  unpacks exactly that).
* ``return_layernorm_output_gathered`` (TE >= 1.5): ``ln_out`` is the gathered [s, b, h] tensor
  (the same one the GEMM consumed, so the adapter needs no all-gather of its own) instead of the
  local shard [s/t, b, h].

:class:`FakeTELayerNormColumnParallelLinear` keeps that contract with Megatron Core's own
tensor-parallel building blocks, so its numerics, saved tensors and collectives are those of a
Megatron linear:

* not gathered: the GEMM all-gathers the shard internally (a transient) and ``ln_out`` is the
  shard itself; the grad arriving for ``ln_out`` is added to the shard's grad after the GEMM's
  reduce-scatter.
* gathered: one explicit all-gather produces ``ln_out`` and the GEMM runs on it; the grad
  arriving for ``ln_out`` is added to the GEMM's input grad before the single reduce-scatter.

Attributes Bridge reads: ``config``, ``in_features`` and ``out_features`` (per rank, as TE),
``sequence_parallel``, ``parallel_mode`` (``"column"``), ``ub_overlap_ag_fprop`` (False),
``return_layernorm_output`` and ``return_layernorm_output_gathered`` (both False until an adapter
asks, as in TE). Parameters are named as TE names them (``layer_norm_weight``,
``layer_norm_bias``, ``weight``) and carry Megatron's TP attributes. Weights are drawn from a
seeded generator on the full [out, h] matrix and sliced per rank, so two instances built with
the same seed are identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FakeTELayerNormColumnParallelLinear(nn.Module):
    """LayerNorm followed by a column-parallel GEMM with TE's return-layernorm-output contract."""

    def __init__(self, input_size: int, output_size: int, *, config, tp_group, seed: int = 0, eps: float = 1e-5):
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        tp = tp_group.size()
        if output_size % tp:
            raise ValueError(f"output_size={output_size} is not divisible by the TP size {tp}")
        self.config = config
        self.tp_group = tp_group
        self.sequence_parallel = bool(config.sequence_parallel)
        self.parallel_mode = "column"
        self.ub_overlap_ag_fprop = False
        self.in_features = input_size
        self.out_features = output_size // tp
        self.eps = eps
        self.return_layernorm_output = False
        self.return_layernorm_output_gathered = False

        generator = torch.Generator().manual_seed(seed)
        dtype = config.params_dtype
        full_weight = torch.randn(output_size, input_size, generator=generator).mul_(input_size**-0.5)
        self.weight = nn.Parameter(full_weight.chunk(tp, dim=0)[tp_group.rank()].to(dtype).contiguous())
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        self.layer_norm_weight = nn.Parameter(
            (1.0 + 0.1 * torch.randn(input_size, generator=generator)).to(dtype)
        )
        self.layer_norm_bias = nn.Parameter((0.1 * torch.randn(input_size, generator=generator)).to(dtype))
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            param.sequence_parallel = self.sequence_parallel  # their grads are summed over the TP group

    def _gemm(self, ln_out: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        from megatron.core.tensor_parallel.layers import (
            linear_with_frozen_weight,
            linear_with_grad_accumulation_and_async_allreduce,
        )

        linear = linear_with_grad_accumulation_and_async_allreduce if self.weight.requires_grad else linear_with_frozen_weight
        return linear(
            ln_out,
            self.weight,
            None,
            gradient_accumulation_fusion=False,
            allreduce_dgrad=False,
            sequence_parallel=sequence_parallel,
            tp_group=self.tp_group,
        )

    def forward(self, x: torch.Tensor):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        ln_local = F.layer_norm(x, (self.in_features,), self.layer_norm_weight, self.layer_norm_bias, self.eps)
        if self.sequence_parallel and self.return_layernorm_output and self.return_layernorm_output_gathered:
            ln_out = gather_from_sequence_parallel_region(ln_local, group=self.tp_group)
            out = self._gemm(ln_out, sequence_parallel=False)
        else:
            ln_out = ln_local
            out = self._gemm(ln_local, sequence_parallel=self.sequence_parallel)
        if self.return_layernorm_output:
            return (out, ln_out), None
        return out, None
