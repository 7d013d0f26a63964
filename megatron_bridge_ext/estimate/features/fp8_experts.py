"""FP8 on the routed experts' linears: their quantised weights and the quantised inputs Transformer Engine keeps.

Core's TE spec builds the routed experts as ``TEGroupedMLP`` (``transformer/moe/experts.py``), whose ``linear_fc1``
and ``linear_fc2`` are TE ``GroupedLinear`` modules (``extensions/transformer_engine.py`` ``TEGroupedLinear``, which
passes ``is_first_microbatch`` unless ``disable_parameter_transpose_cache``, L2422-2431). Under FP8, Core first pads
each local expert's tokens to a multiple of the FP8 alignment (``Fp8Padding``, experts.py L304-310, L767-780;
``fp8_utils.get_fp8_align_size``: 32 for MXFP8, else 16), unless the router or the dispatcher already padded them
(``moe_utils.skip_routed_expert_padding``, which pads to the same size). Per TE v2.17.1
(``transformer_engine/pytorch/module/grouped_linear.py``, commit 4329ff84), on Hopper:

* **weights**: one per expert (``weight{i}``, L1349); each is quantised rowwise and, when the input needs a
  gradient, columnwise (L466-480, L555-571) and cached between the microbatches in ``_fp8_workspaces["weight{i}"]``
  (L1758-1797), or is itself the quantised parameter (``fp8_param``): the per-expert shapes go into
  :func:`..precision.fp8_weights` as the dense linears' do;
* **inputs**: each expert's padded rows are quantised apart (``tex.split_quantize``, L533-544) with rowwise and,
  for a trainable weight, columnwise usage (L455-465); the rowwise data is dropped and the columnwise copy saved
  (L623-635, L647-653); a frozen weight saves no input (L636-637). The grouped-tensor path that quantises the
  inputs as one (L116-141) runs only with ``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM`` and, under FP8, only on
  Blackwell. ``save_original_input`` (the bf16 input kept, L623-626) is set by Core only under ``moe_act``
  recompute (refused under FP8 by :mod:`.moe_act`) and, but for MXFP8, when ``expert_fc1`` is offloaded (the
  experts' groups under FP8 are refused by :mod:`.expert_offload`).

The local spec that is traced runs ``SequentialMLP``: the same padding (experts.py L1304-1316, L1339-1365), then
each expert's ``linear_fc1`` keeps its padded bf16 input [rows, hidden] (views of one storage where no padding was
needed, so the meter cannot attribute it per module) and ``linear_fc2`` its bf16 input [rows, ffn], the activation's
output, kept by it alone. Under TE neither bf16 copy is kept: the contract (:func:`contract`) takes both off by
shape and adds the quantised columnwise copies, for each local expert of each FP8 MoE layer, from the tokens the
stated load routes to this rank's experts (:class:`..routing.RoutedLoad`). What the activation function keeps (fc1's
output, the probabilities) stays as traced in bf16, as TE keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge_ext.findings import ERROR, Finding

MXFP8_ALIGN, FP8_ALIGN = 32, 16
"""The rows Core pads each expert's tokens to under FP8 (``fp8_utils.get_fp8_align_size``)."""
SOURCE = "TE v2.17.1 module/grouped_linear.py"


def findings(model) -> list[Finding]:
    """FP8 on the MoE variants whose TE linears the contract does not follow: shared experts (TE ``Linear`` modules
    on the router's input) and latent MoE's projections around the experts (the experts' offload groups under FP8:
    :func:`.expert_offload.findings`)."""
    if not (getattr(model, "fp8", None) and _has_moe_layers(model)):
        return []
    out = []
    if getattr(model, "moe_shared_expert_intermediate_size", None):
        out.append(Finding("unsupported_model", ERROR, "model.fp8",
                           "FP8 on shared experts is not modelled by the estimate (their TE linears' quantised "
                           "weights and inputs are not counted)", "estimate the bf16 config"))
    if getattr(model, "moe_latent_size", None):
        out.append(Finding("unsupported_model", ERROR, "model.fp8",
                           "FP8 on latent MoE's projections is not modelled by the estimate (their TE linears' "
                           "quantised weights and inputs are not counted)", "estimate the bf16 config"))
    return out


def _has_moe_layers(model) -> bool:
    """Experts configured, and for a hybrid model MoE layers in its pattern."""
    from megatron_bridge_ext.estimate import unmodelled

    pattern = unmodelled.hybrid_pattern(model)
    return bool(getattr(model, "num_moe_experts", None)) and (pattern is None or unmodelled.MOE in pattern)


def align(recipe: str) -> int:
    return MXFP8_ALIGN if recipe == "mxfp8" else FP8_ALIGN


def rows_per_expert(routed: int, experts: int, recipe: str) -> int:
    """One local expert's rows as its grouped linears see them: its share of the ``routed`` tokens, padded."""
    step = align(recipe)
    return -(-(-(-routed // experts)) // step) * step


@dataclass(frozen=True)
class ExpertShapes:
    """The routed experts of one MoE layer on this rank: ``experts`` local experts, ``hidden`` (fc1's input width),
    ``ffn`` (fc2's input width on this expert-TP rank), ``routed`` tokens reaching them per microbatch."""

    experts: int
    hidden: int
    ffn: int
    routed: int


@dataclass(frozen=True)
class ExpertActivations:
    """Per microbatch, over the stage's FP8 MoE layers: ``removed`` bf16 inputs TE does not keep, ``added`` the
    quantised ones it keeps, and the rows each expert's linears see."""

    removed: int
    added: int
    layers: int
    rows: int
    experts: int


def contract(recipe: str, shapes: ExpertShapes, layers: int, element: int) -> ExpertActivations:
    """TE's contract for the trainable experts of ``layers`` FP8 MoE layers (``element``: the bf16 bytes)."""
    from megatron_bridge_ext.estimate.te_fp8 import COLUMNWISE, activation_bytes

    rows = rows_per_expert(shapes.routed, shapes.experts, recipe)
    per_expert_removed = rows * (shapes.hidden + shapes.ffn) * element
    per_expert_added = (activation_bytes(rows, shapes.hidden, recipe, COLUMNWISE)
                        + activation_bytes(rows, shapes.ffn, recipe, COLUMNWISE))
    each = layers * shapes.experts
    return ExpertActivations(each * per_expert_removed, each * per_expert_added, layers, rows, shapes.experts)


def assumption(acts: ExpertActivations) -> str:
    return (f"FP8 experts by Transformer Engine's contract ({SOURCE}, estimate.features.fp8_experts), per "
            f"microbatch: in {acts.layers} FP8 MoE layer(s), each of {acts.experts} local expert(s) keeps linear_fc1's "
            f"and linear_fc2's inputs quantised, columnwise ({acts.rows} rows padded for FP8), in place of the bf16 "
            f"inputs the traced local experts keep: {acts.removed:,} B less, {acts.added:,} B more")
