"""FP8 training in the static part of the estimate: what Transformer Engine keeps per linear layer.

The settings are read from the model config after Bridge's mixed-precision recipe has been applied to
it (``megatron.bridge.training.mixed_precision``: ``bf16_with_fp8_current_scaling_mixed`` sets
``fp8="hybrid"``, ``fp8_recipe="tensorwise"``, ``fp8_param_gather=True`` and keeps the first and last
layer in bf16; ``bf16_with_fp8_delayed_scaling_mixed``, ``bf16_with_mxfp8_mixed``,
``bf16_with_fp8_subchannel_scaling_mixed`` the other recipes). Which layers run in FP8 is Megatron
Core's rule (``fp8_utils.is_first_last_bf16_layer``): with ``first_last_layers_bf16`` the global
layers ``< num_layers_at_start_in_bf16`` and ``>= num_layers - num_layers_at_end_in_bf16`` stay in
bf16, and ``get_fp8_context(..., is_init=True)`` creates FP8 parameters (``fp8_param``) only in the
others. The dense linears of an FP8 layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``; a hybrid model's Mamba mixer's ``in_proj`` and ``out_proj``) and each local routed expert's
``linear_fc1`` and ``linear_fc2`` (TE's ``GroupedLinear`` quantises and caches one weight per expert,
:mod:`.features.fp8_experts`) are Transformer Engine modules; per rank, on Hopper (H100, H200):

* without FP8 parameters the weights stay 16-bit and TE caches a quantised copy of each between the
  microbatches of a step: Core passes ``is_first_microbatch`` (``extensions/transformer_engine.py``,
  ``TELinear.forward``: None only with ``disable_parameter_transpose_cache``), so TE's ``_Linear``
  quantises the weight into the workspace ``"weight"`` with rowwise and, when the input needs a
  gradient, columnwise usage (TE v2.8 ``module/linear.py`` L241-259) and keeps it in
  ``self._fp8_workspaces`` (``module/base.py`` L1380-1381, L1418-1435);
* with FP8 parameters (``fp8_param``; Bridge keeps it equal to ``fp8_param_gather``) the weight *is*
  the quantised tensor: its rowwise bytes live in Megatron's parameter buffer as uint8
  (``distributed/param_and_grad_buffer.py``: ``param_dtype = torch.uint8`` for quantized storage),
  and TE adds the columnwise copy when the backward needs it (``get_weight_workspace`` updates the
  usage of a quantized weight and keeps it, base.py L1365-1373); no workspace is cached;
* the quantised layout per recipe (TE v2.8 ``tensor/``): tensorwise and delayed scaling
  (``Float8Tensor``) keep the data and its transpose, one byte each per element, and an fp32 scale
  (``float8_tensor.py`` L106-126, L288-309); MXFP8 keeps rowwise and columnwise data, one byte each,
  and one E8M0 byte per 32 elements in each direction, padded to 128 x 4 (``mxfp8_tensor.py``
  L101-119); blockwise (``Float8BlockwiseQTensor``, weights in 128 x 128 blocks) keeps both data
  layouts and an fp32 scale per block in each direction, the inner side padded to 4
  (``float8_blockwise_tensor.py`` L137-145, L227-247).

The gradient buffer and the optimizer do not change: Megatron's DDP gives a quantised parameter the
grad dtype of its nominal dtype (fp32 with ``grad_reduce_in_fp32``, else bf16), and the optimizer
keeps an fp32 main copy of it like any 16-bit parameter. What FP8 changes in the activations (the
FP8 linears save quantised inputs, some of them beside a bf16 copy another op keeps) is TE's contract
in :mod:`.te_fp8`, applied to the bf16 trace; what it leaves as traced is named (:func:`activation_note`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.estimate.report import STATIC, Component
from megatron_bridge_ext.findings import ERROR, Finding, Refused

TENSORWISE, DELAYED, MXFP8, BLOCKWISE = "tensorwise", "delayed", "mxfp8", "blockwise"
RECIPES = (TENSORWISE, DELAYED, MXFP8, BLOCKWISE)
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
"""The dense linear layers of a transformer layer that Transformer Engine runs in FP8."""
MAMBA_LINEARS = ("mixer.in_proj", "mixer.out_proj")
"""A hybrid model's Mamba mixer's TE linears (``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``)."""
MXFP8_BLOCK = 32
BLOCK = 128
TE_SOURCE = "TE v2.8"


@dataclass(frozen=True)
class Fp8:
    """The FP8 settings of a model config, as Megatron Core reads them."""

    recipe: str
    fp8_format: str
    params: bool
    bf16_at_start: int
    bf16_at_end: int
    num_layers: int
    weight_cache: bool
    dot_product_attention: bool = False

    def layer_in_fp8(self, layer_no: int) -> bool:
        """Whether global layer ``layer_no`` (0-based) runs in FP8: Core's ``is_first_last_bf16_layer`` negated."""
        return self.bf16_at_start <= layer_no < self.num_layers - self.bf16_at_end

    def describe(self) -> str:
        kept = (f"; the first {self.bf16_at_start} and last {self.bf16_at_end} layer(s) in bf16"
                if self.bf16_at_start or self.bf16_at_end else "")
        return (f"FP8 {self.fp8_format}, recipe {self.recipe}, "
                f"{'FP8 parameters (fp8_param_gather)' if self.params else '16-bit parameters'}{kept}")


def fp8_of(model) -> Optional[Fp8]:
    """The FP8 settings of a finalized-or-not model config with mixed precision applied; None without FP8."""
    fmt = getattr(model, "fp8", None)
    if not fmt:
        return None
    keep = bool(getattr(model, "first_last_layers_bf16", False))
    recipe = getattr(model, "fp8_recipe", TENSORWISE)
    return Fp8(recipe=str(getattr(recipe, "value", recipe)), fp8_format=str(getattr(fmt, "value", fmt)),
               params=bool(getattr(model, "fp8_param", False)),
               bf16_at_start=getattr(model, "num_layers_at_start_in_bf16", 0) if keep else 0,
               bf16_at_end=getattr(model, "num_layers_at_end_in_bf16", 0) if keep else 0,
               num_layers=model.num_layers,
               weight_cache=not getattr(model, "disable_parameter_transpose_cache", False),
               dot_product_attention=bool(getattr(model, "fp8_dot_product_attention", False)))


def mixed_precision_of(cfg):
    """A copy of the config's ``MixedPrecisionConfig`` (a recipe name resolved by Bridge), or a one-line refusal
    for a name Bridge does not know."""
    return mixed_precision_named(cfg.mixed_precision)


def mixed_precision_named(value):
    """A copy of Bridge's ``MixedPrecisionConfig`` for a recipe name (or of the object given), or a one-line
    refusal naming ``mixed_precision`` for a name Bridge does not know."""
    from megatron.bridge.training.mixed_precision import MIXED_PRECISION_RECIPES, get_mixed_precision_config

    try:
        return copy.deepcopy(get_mixed_precision_config(value))
    except ValueError:
        names = ", ".join(sorted(n for n in MIXED_PRECISION_RECIPES if "-" not in n))
        raise Refused("memory estimate", [Finding(
            "bad_input", ERROR, "mixed_precision", f"{value!r} is not a mixed-precision recipe of "
            "Bridge's", f"use one of {names}")]) from None


SECTIONS = ("model", "optimizer", "ddp")
"""The configs Bridge's ``MixedPrecisionConfig.setup`` writes its fields into (mixed_precision.py L113-135)."""


def replaced_by_mixed_precision(cfg, overrides=()) -> list[str]:
    """One line per override of ``model``, ``optimizer`` or ``ddp`` that the mixed-precision config will replace.

    Bridge's ``update_config_with_precision_overrides`` (mixed_precision.py L148-156) copies every field of the
    ``MixedPrecisionConfig`` that the target config has, over whatever the recipe or an override set there; the
    line says which value trains, where it comes from, and the override that changes it.
    """
    yours = _override_keys(overrides)
    if cfg.mixed_precision is None or not yours:
        return []
    mixed = mixed_precision_of(cfg)
    named = cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else "its fields as resolved and overridden"
    out = []
    for f in dataclasses.fields(mixed):
        new = getattr(mixed, f.name)
        for section in SECTIONS:
            target = getattr(cfg, section, None)
            if target is None or not hasattr(target, f.name) or getattr(target, f.name) == new:
                continue
            key = f"{section}.{f.name}"
            if key not in yours:
                continue
            out.append(f"{key}={yours[key]} is replaced by mixed_precision ({named}): {f.name}={new!r} trains (Bridge's "
                       f"MixedPrecisionConfig.setup copies its fields into model, optimizer and ddp); to train with "
                       f"another value write mixed_precision.{f.name}=VALUE")
    return out


def _override_keys(overrides) -> dict[str, str]:
    from megatron_bridge_ext import overrides as checks

    return {o.key_or_group: o.input_line.partition("=")[2] for o in checks.parse(overrides)} if overrides else {}


def fp8_of_config(cfg) -> Optional[Fp8]:
    """The FP8 settings a Bridge ``ConfigContainer`` trains with: its mixed-precision recipe applied to a copy
    of its model config, as Bridge applies it at start-up."""
    if cfg.mixed_precision is None:
        return fp8_of(cfg.model)
    mixed = mixed_precision_of(cfg)
    if mixed.fp8_param is None:  # what finalize() does for FP8 (its FP4 checks need Transformer Engine)
        mixed.fp8_param = mixed.fp8_param_gather
    model = copy.copy(cfg.model)
    mixed.setup(model)
    return fp8_of(model)


def quantized_bytes(shape, recipe: str) -> int:
    """Bytes of one weight of ``shape`` quantised by TE for forward and backward (rowwise + columnwise)."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    data = rows * cols
    if recipe in (TENSORWISE, DELAYED):
        return 2 * data + 4
    if recipe == MXFP8:
        rowwise_scales = round_up(rows, 128) * round_up(cols // MXFP8_BLOCK, 4)
        columnwise_scales = round_up(rows // MXFP8_BLOCK, 4) * round_up(cols, 128)
        return 2 * data + rowwise_scales + columnwise_scales
    if recipe == BLOCKWISE:
        rowwise_scales = math.ceil(rows / BLOCK) * round_up(math.ceil(cols / BLOCK), 4)
        columnwise_scales = math.ceil(cols / BLOCK) * round_up(math.ceil(rows / BLOCK), 4)
        return 2 * data + 4 * (rowwise_scales + columnwise_scales)
    raise ValueError(f"fp8_recipe={recipe!r}: the estimate knows {', '.join(RECIPES)}")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Fp8Weights:
    """The FP8 linear weights of one rank: their shapes, element count and quantised bytes."""

    shapes: list[tuple[int, ...]]
    elements: int
    quantized: int
    layers: int
    expert_elements: int = 0
    """The part of ``elements`` in the routed experts' linears."""


def fp8_weights(model, fp8: Fp8, global_layers: Optional[list[int]] = None,
                sources: Optional[list[int]] = None) -> Fp8Weights:
    """The weights of the Transformer Engine linears of this rank's FP8 layers, frozen or not: the dense linears a
    layer has (:data:`LINEARS`, a hybrid model's Mamba mixer's :data:`MAMBA_LINEARS`) and each local expert's
    ``linear_fc1`` and ``linear_fc2`` (TE's ``GroupedLinear`` keeps one quantised weight per expert,
    :func:`_expert_linears`).
    Global layer numbers decide which layers run in FP8: ``global_layers``, one per layer of the real stage, else the
    traced layers' own numbers. ``sources``: for a stage traced reduced, the traced layer each real layer repeats
    (``memory.traced_layers``). A PEFT's adapters stay in 16 bits (they are not TE modules)."""
    traced = list(model.decoder.layers)
    sources = sources if sources is not None else list(range(len(traced)))
    shapes = []
    layers = experts = 0
    for index, source in enumerate(sources):
        layer = traced[source]
        if not fp8.layer_in_fp8(global_layers[index] if global_layers is not None else layer.layer_number - 1):
            continue
        layers += 1
        dense = _weight_shapes(_dense_linears(layer))
        routed = _weight_shapes(_expert_linears(layer))
        shapes += dense + routed
        experts += sum(math.prod(s) for s in routed)
    return Fp8Weights(shapes, sum(math.prod(s) for s in shapes), sum(quantized_bytes(s, fp8.recipe) for s in shapes),
                      layers, experts)


def _weight_shapes(linears: list) -> list[tuple[int, ...]]:
    weights = (getattr(getattr(linear, "to_wrap", linear), "weight", None) for linear in linears)  # a PEFT wraps it
    return [tuple(w.shape) for w in weights if w is not None]


def _dense_linears(layer) -> list:
    """The dense linears of ``layer`` it has (an MoE layer has no ``mlp.linear_fc1``, a Mamba layer no attention)."""
    out = []
    for path in LINEARS + MAMBA_LINEARS:
        try:
            out.append(layer.get_submodule(path))
        except AttributeError:
            continue
    return out


def _expert_linears(layer) -> list:
    """Each local expert's ``linear_fc1`` and ``linear_fc2`` (SequentialMLP's ``local_experts``, as traced): Core's
    ``TEGroupedMLP`` has the same weights, one ``weight{i}`` per expert in each ``GroupedLinear``."""
    experts = getattr(getattr(getattr(layer, "mlp", None), "experts", None), "local_experts", None) or []
    return [getattr(expert, name) for expert in experts for name in ("linear_fc1", "linear_fc2")]


def component(weights: Fp8Weights, fp8: Fp8) -> Optional[Component]:
    """The FP8 weight bytes of the rank: the parameters themselves (``fp8_param``) or TE's cached copies."""
    if not weights.elements:
        return None
    layout = _layout(fp8.recipe)
    if fp8.params:
        return Component(STATIC, "weights: FP8 linear weights", weights.quantized,
                         f"{weights.elements:,} parameters of the {weights.layers} FP8 layers' {_linears(weights)} "
                         "stored "
                         f"quantised ({layout}): rowwise bytes in Megatron's uint8 parameter buffer with the "
                         f"distributed optimizer, columnwise copy kept by TE for backward ({TE_SOURCE} module/base.py "
                         "L1365-1373)")
    if not fp8.weight_cache:
        return None
    return Component(STATIC, "FP8 weight copies (TE workspaces)", weights.quantized,
                     f"{weights.elements:,} 16-bit weights of the {weights.layers} FP8 layers' {_linears(weights)}, "
                     "each "
                     f"cached quantised between microbatches ({layout}; {TE_SOURCE} module/linear.py L241-259, "
                     "module/base.py L1380-1435)")


def _linears(weights: Fp8Weights) -> str:
    if not weights.expert_elements:
        return "dense linears"
    return f"linears ({weights.expert_elements:,} in the routed experts' grouped linears, one weight per expert)"


def _layout(recipe: str) -> str:
    return {TENSORWISE: "1 B data + 1 B transpose per element, fp32 scale",
            DELAYED: "1 B data + 1 B transpose per element, fp32 scale",
            MXFP8: "1 B rowwise + 1 B columnwise per element, 1 B scale per 32 each way",
            BLOCKWISE: "1 B rowwise + 1 B columnwise per element, fp32 scale per 128 x 128 block each way"}[recipe]


def stored_apart(weights: Fp8Weights, fp8: Optional[Fp8]) -> dict[str, int]:
    """Parameters per weights line (``static``'s part names) that :func:`component` counts instead (FP8 parameters
    only): the experts' on the experts line, the rest on the transformer layers'."""
    if fp8 is None or not fp8.params:
        return {}
    return {"transformer layers": weights.elements - weights.expert_elements, "experts": weights.expert_elements}


def activation_note(fp8: Fp8) -> Optional[str]:
    """The part of the activations under FP8 the estimate does not model, by name: blockwise scaling's (the
    other recipes follow TE's contract, :mod:`.te_fp8`, which says what it models among the assumptions)."""
    if fp8.recipe != BLOCKWISE:
        return None
    return (f"activations under FP8 are not modelled for blockwise scaling ({fp8.describe()}): Transformer Engine "
            "quantises activations in 1 x 128 blocks in layouts that follow its all-gather usage, which the FP8 "
            "contract (estimate.te_fp8) does not follow; they are shown as traced in bf16, above what the FP8 "
            "linears keep of their own inputs; a LoRA-adapted linear_qkv / linear_fc1 counts a bf16 norm-output "
            "shard under sequence parallelism (above TE's quantised one), and none without it, where TE keeps a "
            "quantised copy beside LoRA-A's input")


def notes(fp8: Optional[Fp8]) -> list[str]:
    """What the estimate assumes or leaves out for this FP8 config (empty without FP8)."""
    if fp8 is None:
        return []
    out = [line for line in [activation_note(fp8)] if line]
    if fp8.dot_product_attention:
        out.append("fp8_dot_product_attention: attention in FP8 is not modelled (what it saves is shown as traced in "
                   "bf16)")
    out.append("FP8 weights: Hopper layout (Float8 tensors keep a transpose; Blackwell, with non-TN FP8 GEMMs, keeps "
               "none: 1 B per element less for tensorwise and delayed scaling); the dense linears and each local "
               "expert's "
               "linear_fc1 and linear_fc2 (one quantised weight per expert in TE's GroupedLinear)")
    if not fp8.weight_cache and not fp8.params:
        out.append("disable_parameter_transpose_cache: TE quantises each weight for every microbatch and keeps that "
                   "copy for backward; not modelled")
    return out
