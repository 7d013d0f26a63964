"""What Transformer Engine keeps of the FP8 linears' inputs, against the bf16 trace of the local spec.

Megatron Core's TE layer spec builds ``linear_qkv`` and ``linear_fc1`` as ``TELayerNormColumnParallelLinear``
(TE's ``LayerNormLinear``, autograd function ``_LayerNormLinear``) and ``linear_proj`` and ``linear_fc2``
as ``TERowParallelLinear`` (TE's ``Linear``, ``_Linear``); the local spec that is traced saves each
linear's input in bf16. In an FP8 layer, per TE v2.8 (``transformer_engine/pytorch/``):

* **trainable weight, ``LayerNormLinear``** (``module/layernorm_linear.py``): the input is needed for the
  weight gradient (``backward_needs_input``, L164), so the norm writes its output quantised (L198-203:
  no norm output is returned) and no bf16 norm output exists. Under sequence parallelism with tensorwise or
  delayed scaling (``Float8Quantizer`` / ``Float8CurrentScalingQuantizer`` support only rowwise all-gather,
  ``tensor/float8_tensor.py`` L187-191, L384-388) the saved shard keeps its rowwise data (L186-193, L405-414);
  otherwise (no gather, or MXFP8, whose quantizer gathers columnwise data, ``tensor/quantized_tensor.py``
  L263-265) its rowwise data is dropped and the columnwise data kept (L408-414). Saved with the norm's input
  and statistics (L448-458), which stay as traced;
* **trainable weight, ``Linear``** (``module/linear.py``, row-parallel, no gather): the input is quantised
  with columnwise usage (L218-228), its rowwise data dropped (L371-385) and the columnwise data saved
  (L388-390, L423-429); unless ``save_original_input`` (L361-363), which Megatron Core sets on
  ``linear_proj`` for every recipe but delayed scaling (``transformer/attention.py``,
  ``set_save_original_input``, TE >= 2.6; TE asserts it is not used with delayed scaling, L170-173): then
  the bf16 input itself is saved, the attention output attention keeps anyway;
* **frozen weight** (a PEFT's base layer): ``backward_needs_input`` is False (linear.py L135,
  layernorm_linear.py L164): ``Linear`` saves no input (L388-390), ``LayerNormLinear`` frees its norm output
  (L362-364), as the local spec's ``LinearWithFrozenWeight`` saves none; but Bridge's LoRA makes a
  ``LayerNormLinear`` it adapts return its norm output (``return_layernorm_output``), which keeps the
  quantised copy TE made of its local norm-output shard, rowwise only (quantizer usage L186-193; the copy
  L240, L250-251, L268; kept L362-364, saved L448-458). LoRA-A keeps the bf16 norm output beside it (the
  gathered one on Bridge's path; the shard under our ``regather`` / ``shard_local``; the whole output
  without sequence parallelism): **one quantised shard per adapted layer is added**, in place of the bf16
  shard :mod:`.te` adds for a bf16 layer (under FP8 the bf16 shard is replaced by its quantised copy, L240).

A hybrid model's Mamba mixer follows the same contract: Core's hybrid spec builds its ``in_proj`` as
``TELayerNormColumnParallelLinear`` (the layer's norm fused, as ``linear_qkv``) and its ``out_proj`` as
``TERowParallelLinear`` (as ``linear_fc2``, no ``save_original_input``; ``models/hybrid/hybrid_layer_specs.py``
L93-101), where the traced local spec has a separate norm and plain linears; ``out_proj``'s input is the gated norm's
output [s, b, heads x head dim / TP].

Where the traced bf16 input was kept by that linear alone (the meter's ``by_module_alone``), TE's quantised
input replaces it; where another op keeps the same storage (``linear_proj``'s input, kept by attention),
the quantised copy comes on top. Bytes per layout (``tensor/``): tensorwise and delayed scaling keep
1 B per element and an fp32 scale (``float8_tensor.py`` L92-126); MXFP8 1 B per element and one E8M0
byte per 32 elements along the kept direction, padded to 128 x 4 (``mxfp8_tensor.py`` L101-119).
Blockwise (subchannel) scaling is refused by name (:func:`refused`): its activation layouts follow TE's
all-gather usage, which this contract does not model. So is selective ``layernorm`` recompute: Core's TE
spec fuses the norm into ``linear_qkv`` / ``linear_fc1`` (nothing to recompute) where the traced local spec
checkpoints a separate norm, so the inputs of those two linears are left as traced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from megatron_bridge_ext.estimate import te
from megatron_bridge_ext.estimate.precision import BLOCKWISE, DELAYED, MXFP8, MXFP8_BLOCK, TE_SOURCE, Fp8, round_up
from megatron_bridge_ext.estimate.report import ACTIVATIONS, Component
from megatron_bridge_ext.estimate.trace import category_of, layer_of

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.features import fp8_experts

ROWWISE, COLUMNWISE = "rowwise", "columnwise"
NORM_LINEARS = ("linear_qkv", "linear_fc1", "in_proj")
"""The linears Core's TE spec fuses with their norm (``LayerNormLinear``; a Mamba mixer's ``in_proj``); the others
(``linear_proj``, ``linear_fc2``, a Mamba mixer's ``out_proj``) are ``Linear``."""

FP8_SHARDS = "TE FP8 norm-output shards (contract)"
"""The component of the quantised norm-output shards TE keeps beside a LoRA-A in FP8 layers."""


@dataclass(frozen=True)
class Shapes:
    """The GEMM input shapes of a layer's dense linears on this rank, as rows x columns."""

    seq: int
    micro_batch: int
    hidden: int
    proj_in: int
    ffn: int
    tp: int
    sequence_parallel: bool
    mamba_inner: int = 0
    """A hybrid model's Mamba mixer's ``out_proj`` input width on this rank (heads x head dim / TP)."""

    def rows(self, column_parallel: bool) -> int:
        """A column-parallel input is the local sequence shard under sequence parallelism; a row-parallel one
        holds the whole sequence."""
        shard = self.tp if column_parallel and self.sequence_parallel else 1
        return self.seq // shard * self.micro_batch

    def of(self, linear: str) -> tuple[int, int]:
        """Rows and columns of the input of ``linear`` (``linear_qkv`` ... ``linear_fc2``; a Mamba mixer's ``in_proj``,
        ``out_proj``)."""
        cols = {"linear_qkv": self.hidden, "linear_fc1": self.hidden, "linear_proj": self.proj_in,
                "linear_fc2": self.ffn, "in_proj": self.hidden, "out_proj": self.mamba_inner}[linear]
        return self.rows(linear in NORM_LINEARS), cols


@dataclass(frozen=True)
class Fp8Activations:
    """What the FP8 contract changes per microbatch, by category: ``removed`` bf16 inputs TE does not keep,
    ``added`` the quantised inputs it keeps (``converted`` linears; ``kept_bf16``: linear_proj inputs saved as
    they are); ``lora_shards`` quantised norm-output shards beside a LoRA-A (``lora_shard_bytes`` in all);
    ``norm_linears`` False where linear_qkv's and linear_fc1's inputs were left as traced."""

    removed: dict[str, int] = field(default_factory=dict)
    added: dict[str, int] = field(default_factory=dict)
    converted: int = 0
    kept_bf16: int = 0
    lora_shards: int = 0
    lora_shard_bytes: int = 0
    recipe: str = ""
    norm_linears: bool = True
    experts: Optional["fp8_experts.ExpertActivations"] = None
    """The routed experts' part (:mod:`.features.fp8_experts`), in ``removed`` and ``added`` too."""

    def net(self, category: str) -> int:
        """The bytes the contract adds to ``category`` (negative: it takes them off)."""
        return self.added.get(category, 0) - self.removed.get(category, 0)


def refused(fp8: Fp8) -> bool:
    """Blockwise scaling: the part of the contract not modelled (activations shown as traced in bf16)."""
    return fp8.recipe == BLOCKWISE


def activation_bytes(rows: int, cols: int, recipe: str, usage: str) -> int:
    """Bytes of one activation [rows, cols] TE keeps quantised with one usage (rowwise or columnwise)."""
    data = rows * cols
    if recipe == MXFP8:
        if usage == ROWWISE:
            return data + round_up(rows, 128) * round_up(cols // MXFP8_BLOCK, 4)
        return data + round_up(rows // MXFP8_BLOCK, 4) * round_up(cols, 128)
    if recipe == BLOCKWISE:
        raise ValueError("blockwise activations are not modelled (te_fp8.refused)")
    return data + 4


def saved_usage(linear: str, fp8: Fp8, sequence_parallel: bool) -> str:
    """The usage of the input a trainable linear saves: rowwise only for a gathered Float8 norm output."""
    if linear in NORM_LINEARS and sequence_parallel and fp8.recipe != MXFP8:
        return ROWWISE
    return COLUMNWISE


def contract(traced, fp8: Fp8, shapes: Shapes, in_fp8: Callable[[int], bool], *,
             norm_linears: bool = True) -> Optional[Fp8Activations]:
    """The FP8 contract against ``traced`` (:class:`..trace.TracedMicrobatch`) for the layers ``in_fp8`` says
    run in FP8 (by their traced index); None where it is refused (:func:`refused`). ``norm_linears``: False
    leaves ``linear_qkv`` and ``linear_fc1`` as traced (selective ``layernorm`` recompute)."""
    if refused(fp8):
        return None
    removed: dict[str, int] = {}
    added: dict[str, int] = {}
    converted = kept = 0
    for module, nbytes in traced.linear_saved.items():
        if not nbytes or not in_fp8(layer_of(module)):
            continue
        linear = _linear_of(module)
        if linear in NORM_LINEARS and not norm_linears:
            continue
        if linear == "linear_proj" and fp8.recipe != DELAYED:
            kept += 1  # save_original_input: the bf16 input, as traced
            continue
        category = category_of(module)
        rows, cols = shapes.of(linear)
        added[category] = added.get(category, 0) + activation_bytes(
            rows, cols, fp8.recipe, saved_usage(linear, fp8, shapes.sequence_parallel))
        removed[category] = removed.get(category, 0) + traced.linear_alone.get(module, 0)
        converted += 1
    adapted = {te.base_layer_of(m) for m in traced.lora_a_saved
               if norm_linears and te.is_te_lora_input(m) and in_fp8(layer_of(m))}
    shard = activation_bytes(shapes.rows(column_parallel=True), shapes.hidden, fp8.recipe, ROWWISE)
    return Fp8Activations(removed, added, converted, kept, len(adapted), len(adapted) * shard, fp8.recipe,
                          norm_linears)


def with_experts(acts: Fp8Activations, category: str, experts) -> Fp8Activations:
    """``acts`` with the routed experts' contract (:func:`.features.fp8_experts.contract`) in ``category``."""
    removed, added = dict(acts.removed), dict(acts.added)
    removed[category] = removed.get(category, 0) + experts.removed
    added[category] = added.get(category, 0) + experts.added
    return dataclasses.replace(acts, removed=removed, added=added, experts=experts)


def basis(acts: Fp8Activations, category: str) -> str:
    """The FP8 contract's change to one category, for its basis text."""
    return (f", less {acts.removed.get(category, 0):,} B of bf16 linear inputs TE does not keep, plus "
            f"{acts.added.get(category, 0):,} B of the quantised inputs it keeps ({TE_SOURCE} FP8 contract)")


def lora_component(acts: Fp8Activations, in_flight: float, fp8: Fp8, *, shard_shape: str) -> Component:
    return Component(ACTIVATIONS, FP8_SHARDS, round(acts.lora_shard_bytes * in_flight),
                     f"Transformer Engine FP8 contract: {acts.lora_shards} LayerNormLinear(s) a LoRA adapts keep a "
                     f"quantised {shard_shape} norm-output shard, rowwise ({_layout(fp8.recipe)}), beside LoRA-A's "
                     f"bf16 input ({TE_SOURCE} layernorm_linear.py L240, L250-251, L268, L362-364) x {in_flight:g} "
                     "microbatch(es)")


def _layout(recipe: str) -> str:
    return "1 B per element, 1 E8M0 scale per 32" if recipe == MXFP8 else "1 B per element, fp32 scale"


def assumptions(acts: Optional[Fp8Activations]) -> list[str]:
    """What the FP8 contract did to this estimate and what it leaves as traced (nothing without FP8)."""
    if acts is None:
        return []
    proj = ("linear_proj's quantised input on top of the attention output attention keeps (delayed scaling: no "
            "save_original_input)" if acts.recipe == DELAYED else
            f"{acts.kept_bf16} linear_proj input(s) kept in bf16, shared with attention (Core's "
            "set_save_original_input)")
    out = [f"FP8 activations by Transformer Engine's contract ({TE_SOURCE}, estimate.te_fp8), per microbatch: "
           f"{acts.converted} trainable linear input(s) kept quantised ({_layout(acts.recipe)}) in place of the "
           f"traced bf16 input where that linear alone kept it; {proj}; frozen base linears keep no input; "
           f"{acts.lora_shards} quantised norm-output shard(s) beside LoRA-A. As traced in bf16, as TE keeps them: "
           "the norms' inputs and statistics, attention's q, k, v, output and statistics, the activation "
           "function's inputs, embedding, logits and loss; the layer full recompute runs again in backward is "
           "shown as traced in bf16 (not modelled)"]
    if acts.experts is not None:
        from megatron_bridge_ext.estimate.features import fp8_experts

        out.append(fp8_experts.assumption(acts.experts))
    if not acts.norm_linears:
        out.append("FP8 activations with selective layernorm recompute: linear_qkv's and linear_fc1's inputs are not "
                   "modelled (TE fuses the norm into them; the local spec checkpoints it apart): shown as traced "
                   "in bf16")
    return out


def _linear_of(module: str) -> str:
    """``linear_fc1`` for ``decoder.layers.N.mlp.linear_fc1`` and for the base linear a PEFT wraps in it."""
    parts = module.split(".")
    return parts[-2] if parts[-1] == "to_wrap" else parts[-1]
