"""The MoE paged stash (Megatron Core 0.19 ``moe_paged_stash``, ``transformer/moe/paged_stash.py``): what it takes
from the saved tensors, and where the estimate cannot follow it.

Core opens the stash only in ``TEGroupedMLP._fused_forward`` (``moe/experts.py`` L654-670), the Transformer Engine
op-fuser path (``use_transformer_engine_op_fuser``, L286-290, L753-761), and its saved-tensor hook takes over only the
tensors that carry ``grouped_tensor_scale_inv`` (``on_save_for_backward``, L679-691); every other saved tensor is
returned as it is. Core never sets that attribute: Transformer Engine's ``mark_grouped_tensor`` does (TE
d0067d0d, ``transformer_engine/pytorch/utils.py`` L308-328), called only by the fused CuTe-GEMM grouped MLP on what it
saves (``ops/fused/grouped_mlp.py`` L1749), and TE fuses that op only for an MXFP8 or NVFP4 recipe (L840-845) on
compute capability 10 with ``NVTE_CUTEDSL_FUSED_GROUPED_MLP`` set (L944-958).

* **Experts in bf16 or another FP8 recipe, or no op fuser** (modelled): no saved tensor is stamped. In the first
  training iteration (``status == 'capture'``, set by the first ``paged_stash_reset``, L906-907) the hook records
  nothing; at the second (L908-915) ``allocate_stash_buffers`` finds no recorded (dtype, hidden) and allocates no
  buffer, GPU or pinned host (L592-598); in every later one it pages nothing. Activations are as traced and the stash
  adds no byte in any phase: :func:`assumption` says so.
* **MXFP8 experts under the op fuser** (refused, :func:`findings`): the stash takes the fused op's saves (the
  experts' MXFP8 inputs with their swizzled block scales, fc1's output, the probabilities) and sizes one buffer per
  (dtype, hidden) from the rows recorded in iteration 1 (``avg_num_tokens`` = the rank budget over
  ``moe_expert_rank_capacity_factor``, experts.py L656-663; x ``moe_paged_stash_buffer_size_factor_cuda``,
  L562-603). The estimate traces the local spec's experts and counts TE's ``GroupedLinear`` contract
  (:mod:`.fp8_experts`), not that fused op, so neither the tensors the stash would take nor the buffers' keys are
  known to it. NVFP4 is refused as FP4 training.
"""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding

FUSED_RECIPES = ("mxfp8",)
"""The FP8 recipes for which TE fuses the grouped MLP whose saves the stash takes (NVFP4 is refused as FP4)."""
SOURCE = "TE d0067d0d ops/fused/grouped_mlp.py L1749, L840-845; Core moe/paged_stash.py L679-691"


def used(model) -> bool:
    return bool(getattr(model, "moe_paged_stash", False))


def takes_saves(model) -> bool:
    """Whether TE's fused grouped MLP, the only code that stamps a saved tensor for the stash, runs the experts."""
    return (bool(getattr(model, "use_transformer_engine_op_fuser", False)) and bool(getattr(model, "fp8", None))
            and getattr(model, "fp8_recipe", None) in FUSED_RECIPES)


def findings(model) -> list[Finding]:
    """One finding when the stash would take the fused MXFP8 grouped MLP's saves."""
    if not (used(model) and takes_saves(model)):
        return []
    return [Finding("unsupported_model", ERROR, "model.moe_paged_stash",
                    "the MoE paged stash with MXFP8 experts under the TE op fuser is not modelled by the estimate: it "
                    "takes what TE's fused CuTe-GEMM grouped MLP saves (stamped grouped_tensor_scale_inv, "
                    f"{SOURCE}), an op the estimate does not trace",
                    "estimate with moe_paged_stash=False, then subtract the experts' saved inputs, fc1 output and "
                    "probabilities and add the stash's buffers (rank budget / moe_expert_rank_capacity_factor x "
                    "MoE layers in flight x moe_paged_stash_buffer_size_factor_cuda rows per dtype and width)")]


def assumption(model) -> str | None:
    """What the estimate counts for a stash that takes nothing; None without the stash."""
    if not used(model) or takes_saves(model):
        return None
    return ("MoE paged stash: no saved tensor is stamped for it (only TE's fused MXFP8/NVFP4 grouped MLP stamps "
            f"grouped_tensor_scale_inv, {SOURCE}), so iteration 1 records nothing and no GPU or pinned host buffer "
            "is allocated (paged_stash.py L592-598): activations as traced, 0 B for the stash in every phase "
            "(estimate.features.paged_stash)")
