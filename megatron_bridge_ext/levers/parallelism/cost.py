"""What resizing the parallel layout costs in the plan: the traffic one rank moves per step (TP and PP activations;
for mixture-of-experts models the token dispatch and the expert weights' data-parallel traffic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_bridge_ext.levers.parallelism.constraints import expert_sizes

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.settings import Settings

BASIS = ("formula: TP 8*s*b*h*e*(t-1)/t per layer and microbatch, PP 2*(s/t)*b*h*e per microbatch, on this rank's "
         "layers, with twice the microbatches per step as DP halves")


def tp_collective_bytes(s: Settings, *, tp: int, layers: int, num_microbatches: int, element: int, moe_layers: int = 0,
                        shared_experts: bool = False) -> int:
    """Bytes one rank moves per step for tensor parallelism's activations: per layer and microbatch,
    2 all-gathers and 2 reduce-scatters of [s, b, h] forward and as many backward (all-reduces
    without SP: the same volume), each moving (t - 1) / t of the tensor from a rank. ``moe_layers`` of the
    ``layers`` have an MoE layer for their MLP: its tokens reach the experts through the token dispatcher
    (:func:`dispatch_bytes_per_layer`), so only attention's half is TP traffic, and the shared experts' half
    when there are shared experts (they follow the attention's TP and SP). A hybrid model's layer (``s.hybrid``) has one
    such part: its Mamba mixer's ``in_proj`` gathers and ``out_proj`` reduce-scatters as
    attention's linears do."""
    if tp == 1:
        return 0
    sbh = s.seq_length * s.micro_batch * s.hidden
    if s.hybrid is not None:  # one part per layer: attention, MLP or Mamba mixer, or an MoE layer's shared experts
        counts = layer_counts(s, None)
        units = 4 * (counts.attention + counts.mlp + counts.mamba) + (4 if shared_experts else 0) * counts.moe
    else:
        units = 8 * (layers - moe_layers) + (8 if shared_experts else 4) * moe_layers
    return units * sbh * element * (tp - 1) * num_microbatches // tp


def p2p_bytes(s: Settings, *, pp: int, tp: int, num_microbatches: int, element: int) -> int:
    """Bytes a pipeline stage sends per step: its output activation forward and its input's gradient
    backward, [s/t, b, h] under SP, per microbatch (none with PP = 1)."""
    if pp == 1:
        return 0
    seq = s.seq_length // tp if s.sequence_parallel else s.seq_length
    return 2 * seq * s.micro_batch * s.hidden * element * num_microbatches


def traffic_change(before: Settings, after: Settings, element: int, moe_before: Optional[dict] = None,
                   moe_after: Optional[dict] = None) -> tuple[int, str]:
    """Change in traffic per step from the estimate settings ``before`` to ``after`` (with the MoE shapes
    :func:`moe_shape` of both for a mixture-of-experts model), with its basis."""

    def volume(s, moe):
        _, moe_layers = stage_layer_kinds(s, moe)
        out = (tp_collective_bytes(s, tp=s.tp, layers=s.layers_on_stage, num_microbatches=s.num_microbatches,
                                   element=element, moe_layers=moe_layers,
                                   shared_experts=bool(moe and moe["shared_ffn"]))
               + p2p_bytes(s, pp=s.pp, tp=s.tp, num_microbatches=s.num_microbatches, element=element))
        return out + (expert_traffic(s, moe, element=element) if moe else 0)

    basis = BASIS + ("; MoE layers: attention's half of the TP term (and the shared experts' half), plus "
                     + EXPERT_BASIS.removeprefix("formula, ") if moe_before or moe_after else "")
    return volume(after, moe_after) - volume(before, moe_before), basis


# ------------------------------------------------------------------------------------------------
# Mixture of experts: what raising EP or ETP moves per step (token dispatch and expert-DP gradients).

EXPERT_BASIS = (
    "formula, per MoE layer on this stage and microbatch, T = s*b/(t*cp) tokens entering the layer on a rank (s/t "
    "under SP), k = top-k, balanced routing: alltoall/flex dispatcher 4*T*k*h*e*(EP-1)/EP (dispatch and combine "
    "all-to-all, forward and backward) + 4*T*k*h*e*(ETP-1) (the expert-TP all-gather and reduce-scatter); allgather "
    "dispatcher 4*T*h*e*(EP*ETP-1); routing probabilities (one scalar per routed token) left out; plus the expert "
    "weights' data-parallel traffic per step, 2*P*e*(EDP-1)/EDP for the P trainable expert parameters on the rank "
    "(gradient reduce-scatter and parameter all-gather over the expert-DP group EDP = t*cp*DP/(ETP*EP))")
DISPATCHERS = ("alltoall", "flex", "allgather")


def moe_shape(model) -> Optional[dict]:
    """The MoE fields of a model config the expert formulas read, Core's defaults filled in; None for a dense model.

    ``moe_ffn`` is ``ffn_hidden_size`` when ``moe_ffn_hidden_size`` is unset and ``etp`` is
    :func:`~megatron_bridge_ext.levers.parallelism.constraints.default_expert_tp` when
    ``expert_tensor_parallel_size`` is, as Megatron Core and Bridge fill them; ``pattern`` marks each
    layer of the model 1 (MoE) or 0 (dense) from ``moe_layer_freq`` (an int N: every N-th layer from the
    first; a list: the pattern itself), as Core's ``get_transformer_layer_spec`` reads it.
    """
    experts = getattr(model, "num_moe_experts", None)
    if not experts:
        return None
    ep, etp = expert_sizes(model)
    freq = getattr(model, "moe_layer_freq", 1) or 1
    layers = model.num_layers
    pattern = [int(bool(x)) for x in freq] if isinstance(freq, (list, tuple)) \
        else [int(i % freq == 0) for i in range(layers)]
    return {"experts": experts, "topk": getattr(model, "moe_router_topk", 2) or 2,
            "moe_ffn": getattr(model, "moe_ffn_hidden_size", None) or model.ffn_hidden_size,
            "shared_ffn": getattr(model, "moe_shared_expert_intermediate_size", None) or 0,
            "ep": ep, "etp": etp,
            "dispatcher": getattr(model, "moe_token_dispatcher_type", None) or "allgather",
            "grouped_gemm": bool(getattr(model, "moe_grouped_gemm", False)), "pattern": pattern}


def stage_layer_kinds(s: Settings, moe: Optional[dict]) -> tuple[int, int]:
    """(dense, MoE) layers on the estimated stage: as the estimate counted them (``s.moe.layers_on_stage``) when its
    settings have the experts, else its first ``layers_on_stage`` layers for stage 0, its last ones for the last
    stage (the two stages the estimate picks from)."""
    layers = s.layers_on_stage
    if moe is None:
        return layers, 0
    if s.moe is not None:
        return layers - s.moe.layers_on_stage, s.moe.layers_on_stage
    pattern = moe["pattern"]
    start = 0 if s.stage == 0 else len(pattern) - layers
    moe_layers = sum(pattern[start:start + layers])
    return layers - moe_layers, moe_layers


@dataclass(frozen=True)
class LayerCounts:
    """The stage's layers by what they hold: attention, a dense MLP, an MoE layer, a Mamba mixer. A GPT layer holds
    attention and an MLP or MoE layer; a hybrid model's layer holds exactly one of the four."""

    attention: int
    mlp: int
    moe: int
    mamba: int = 0


HYBRID_NAMES = {"attention": "attention", "mlp": "MLP", "moe": "MoE", "mamba": "Mamba"}
"""The fields of :class:`LayerCounts` by the estimate's names of a hybrid model's layer kinds (``s.hybrid.layers``)."""


def layer_counts(s: Settings, moe: Optional[dict]) -> LayerCounts:
    """The estimated stage's layers by kind: a hybrid model's from its settings (``s.hybrid.layers``, the stage's own
    segment of its pattern), else :func:`stage_layer_kinds`."""
    if s.hybrid is not None:
        return LayerCounts(**{field: s.hybrid.layers.get(name, 0) for field, name in HYBRID_NAMES.items()})
    dense, moe_layers = stage_layer_kinds(s, moe)
    return LayerCounts(attention=dense + moe_layers, mlp=dense, moe=moe_layers)


def tokens_per_rank(s: Settings) -> int:
    """Tokens one rank feeds an MoE layer per microbatch: its sequence shard under SP (Core requires SP for MoE
    with TP > 1 in training), its context-parallel share."""
    seq = s.seq_length // s.cp
    if s.sequence_parallel:
        seq //= s.tp
    return seq * s.micro_batch


def dispatch_bytes_per_layer(s: Settings, moe: dict, *, ep: int, etp: int, element: int, passes: int = 4) -> int:
    """Bytes one rank sends per MoE layer and microbatch to dispatch its tokens to the experts and combine the
    results, forward and backward (each collective's gradient is the dual collective of the same size): ``passes``
    = 4 collectives of each kind, 2 for the forward alone.

    alltoall (and flex, whose DeepEP/HybridEP kernels move at most as much): the rank sends T*k token copies
    of h elements, (EP-1)/EP of them to other EP ranks, once to dispatch and once to combine, forward and
    backward; with ETP > 1 the received tokens are all-gathered over the expert-TP group and the outputs
    reduce-scattered, each moving (ETP-1) shares of T*k*h per rank. allgather: the T*h hidden states are
    all-gathered over the EP*ETP group and the outputs reduce-scattered, (EP*ETP-1) shares of T*h each.
    """
    t, h, k = tokens_per_rank(s), s.hidden, moe["topk"]
    if moe["dispatcher"] == "allgather":
        return passes * t * h * element * (ep * etp - 1)
    return passes * t * k * h * element * (ep - 1) // ep + passes * t * k * h * element * (etp - 1)


def expert_parameters_per_rank(s: Settings, moe: dict, *, ep: int, etp: int, moe_layers: int) -> int:
    """Routed-expert parameters one rank holds on the stage: E/EP experts per MoE layer, each fc1 (h x moe_ffn,
    twice with a gated unit) and fc2 (moe_ffn x h), sharded over ETP (no bias: Core allows MoE bias only with
    ETP = 1, and it is h + moe_ffn per expert)."""
    per_expert = s.hidden * moe["moe_ffn"] * ((2 if s.gated_linear_unit else 1) + 1)
    return moe_layers * (moe["experts"] // ep) * per_expert // etp


def expert_dp_size(s: Settings, *, ep: int, etp: int) -> int:
    """The expert layers' data-parallel size: the stage's t*cp*DP GPUs over the EP x ETP expert grid."""
    return s.tp * s.cp * s.dp // (ep * etp)


def expert_dp_bytes(s: Settings, moe: dict, *, ep: int, etp: int, moe_layers: int, element: int) -> int:
    """Bytes one rank sends per step for its trainable expert weights over the expert-DP group: the gradient
    reduce-scatter and the parameter all-gather of the distributed optimizer (or one all-reduce of the same
    volume), each (EDP-1)/EDP of the rank's expert parameters. None with PEFT: the base experts are frozen (the
    expert adapters' traffic, a small fraction, is left out)."""
    edp = expert_dp_size(s, ep=ep, etp=etp)
    if s.peft is not None or edp <= 1:
        return 0
    params = expert_parameters_per_rank(s, moe, ep=ep, etp=etp, moe_layers=moe_layers)
    return 2 * params * element * (edp - 1) // edp


def expert_traffic(s: Settings, moe: dict, *, element: int) -> int:
    """Bytes one rank moves per step for its experts at the EP and ETP of ``moe``: dispatch and combine on every
    MoE layer of the stage and microbatch of the step, plus the expert weights' data-parallel traffic."""
    _, moe_layers = stage_layer_kinds(s, moe)
    ep, etp = moe["ep"], moe["etp"]
    dispatch = dispatch_bytes_per_layer(s, moe, ep=ep, etp=etp, element=element) * moe_layers * s.num_microbatches
    return dispatch + expert_dp_bytes(s, moe, ep=ep, etp=etp, moe_layers=moe_layers, element=element)
