"""Optimizer CPU offload: what Megatron Core 0.19's ``HybridDeviceOptimizer`` keeps on the GPU.

With ``optimizer.optimizer_cpu_offload`` Core builds a ``HybridDeviceOptimizer`` over the parameter groups
(``optimizer/__init__.py`` L501-540) with ``param_update_in_fp32=True``; the distributed optimizer rebuilds it over
its shard's main parameters (``distrib_optimizer.py`` L778-781). The hybrid optimizer walks those parameters in
order and moves whole parameters to pinned host memory while the moved elements are fewer than
``optimizer_offload_fraction`` x the GPU elements (``cpu_offloading/hybrid_optimizer.py`` L251-292):

* **moments**: torch's Adam on the host keeps the moments of the moved part; the GPU optimizer (Core's ``Adam``,
  TE's FusedAdam) keeps those of the (1 - fraction) part, fp32, created in its first step. Core passes it no
  ``exp_avg_dtype``/``exp_avg_sq_dtype`` on this path (``__init__.py`` L515-539), so the precision-aware moment
  dtypes do not apply;
* **main copies, distributed optimizer alone**: its fp32 main shard is made for every element on the GPU
  (``distrib_optimizer.py`` L445 ``shard_main_param = shard_model_param.clone().float()``) and stays there: the
  hybrid optimizer's host copy is a clone (``hybrid_optimizer.py`` L274), written back into the GPU tensor after the
  host step (L117-125). The gradient shard is still cast to fp32 on the GPU for every element (``distrib_optimizer.py``
  L2782) and copied to pinned host buffers from there (``hybrid_optimizer.py`` L98-114): no GPU staging buffer,
  with or without ``overlap_cpu_optimizer_d2h_h2d`` (which only adds CUDA streams and one host optimizer per
  parameter, L203-221, L226-249); ``pin_cpu_grads``/``pin_cpu_params`` choose pinned host memory (L110, L274);
* **main copies, precision-aware optimizer**: Core hands the 16-bit shard to the optimizer (``distrib_optimizer.py``
  L452-454, L492-495); the hybrid optimizer makes the fp32 copies itself at construction, on the GPU for the
  (1 - fraction) part and on the host for the rest (``hybrid_optimizer.py`` L277-279), whatever
  ``main_params_dtype`` says.

``use_torch_optimizer_for_cpu_offload`` changes nothing in Core 0.19: the class it picks is overwritten for Adam
and SGD alike right after (``__init__.py`` L513-527).

Its rules (what Core refuses, what is not modelled) are :func:`megatron_bridge_ext.levers.optimizer_offload.findings`,
shared with the search.
"""

from __future__ import annotations

import math
from typing import Optional

from megatron_bridge_ext.levers.optimizer_offload import fraction


def host_elements(elements: int, share: float) -> int:
    """Elements of a shard the hybrid optimizer moves to the host: ``share`` of them, rounded up (it moves whole
    parameters while fewer than the threshold are moved, ``hybrid_optimizer.py`` L258-276; the cut is taken at the
    element, its parameter boundary unknown here)."""
    return min(elements, math.ceil(round(elements * share, 6)))


def assumption(optimizer, *, host: int, elements: int) -> Optional[str]:
    """The estimate's line on what moved to the host, None without the offload."""
    share = fraction(optimizer)
    if share is None:
        return None
    masters = ("and their fp32 main copies (the precision-aware optimizer's, made by the hybrid optimizer)"
               if getattr(optimizer, "use_precision_aware_optimizer", False) else
               "(the fp32 main copies and the fp32 gradient shard stay on the GPU: the host holds clones)")
    return (f"optimizer CPU offload, optimizer_offload_fraction={share:g}: the Adam moments of {host:,} of the rank's "
            f"{elements:,} shard elements live in host memory {masters}; moments fp32 whatever exp_avg_dtype says "
            "(Core's hybrid optimizer, optimizer/cpu_offloading/hybrid_optimizer.py L251-292; optimizer/__init__.py "
            "L501-540)")
