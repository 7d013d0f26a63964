"""CPU emulation of the few CUDA-only calls Megatron Core makes on the TP/SP path.

Used only by the CPU runs of the demo and benchmarks (:mod:`.cpu_run`) and by the tests, when
CUDA is absent, so that 2-rank gloo runs can execute real Megatron Core tensor/sequence-parallel
layers on a CPU machine. No feature of the package imports it. Everything it changes is listed here:

* ``torch.cuda.current_device`` -> ``"cpu"``: Megatron Core allocates gather/reduce-scatter
  outputs and its ``GlobalMemoryBuffer`` on ``torch.cuda.current_device()``.
* the CUDA RNG state calls used by ``CudaRNGStatesTracker`` and activation checkpointing
  (``torch.cuda.get_rng_state``/``manual_seed`` and Megatron Core's ``_get_cuda_rng_state``/
  ``_set_cuda_rng_state``) -> CPU generator states, so that ``model_parallel_cuda_manual_seed``
  and recompute work and stay deterministic.
* ``get_default_causal_mask`` (built with ``device="cuda"``) -> the same mask on the CPU, in
  ``megatron.core.transformer.utils`` and in ``megatron.core.fusions.fused_softmax`` that imports it.
* a CPU stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` (wgrad GEMM accumulated into
  ``main_grad``), so that ``gradient_accumulation_fusion=True`` can be exercised. It must be
  installed before ``megatron.core.tensor_parallel.layers`` is imported.
"""

from __future__ import annotations

import sys
import types

import torch

_INSTALLED = False


def _wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input, computed in main_grad's dtype (as the CUDA kernel)."""
    main_grad.add_(grad_output.to(main_grad.dtype).t().matmul(total_input.to(main_grad.dtype)))


def _fake_fused_wgrad_module() -> types.ModuleType:
    module = types.ModuleType("fused_weight_gradient_mlp_cuda")
    module.__doc__ = "CPU stand-in installed by tests/support/cpu_emulation.py"
    module.wgrad_gemm_accum_fp32 = _wgrad_gemm_accum
    module.wgrad_gemm_accum_fp16 = _wgrad_gemm_accum
    return module


def install() -> bool:
    """Install the CPU redirections when CUDA is absent. Returns True when installed."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    if "megatron.core.tensor_parallel.layers" in sys.modules and "fused_weight_gradient_mlp_cuda" not in sys.modules:
        raise RuntimeError(
            "tests.support.cpu_emulation.install() must run before megatron.core.tensor_parallel is imported"
        )
    sys.modules.setdefault("fused_weight_gradient_mlp_cuda", _fake_fused_wgrad_module())

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it; the CPU generator is already seeded

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    def cpu_causal_mask(sq: int) -> torch.Tensor:
        """A fresh mask per call, as Megatron Core's (0.19) builds one per call and layer."""
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    transformer_utils.get_default_causal_mask = cpu_causal_mask
    fused_softmax.get_default_causal_mask = cpu_causal_mask
    _INSTALLED = True
    return True
