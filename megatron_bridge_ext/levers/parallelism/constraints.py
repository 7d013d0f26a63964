"""What a parallel layout (expert-parallel sizes included) or CPU offloading cannot be combined with, checked
before launch."""

from __future__ import annotations

import math
from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding

MAX_TP = 8
"""Largest TP the planner proposes: one NVLink node (8 GPUs); beyond it TP traffic leaves NVLink."""


def model_findings(model, granularity: Optional[str]) -> list[Finding]:
    """Megatron Core's refusals on offloading, CUDA graphs and saved activations, given the recompute
    granularity the model will have (:meth:`megatron_bridge_ext.levers.recompute.config.RecomputeConfig.granularity`)."""
    out = []
    if getattr(model, "cpu_offloading", False):
        if granularity is not None:
            out.append(Finding("offload_with_recompute", ERROR, "model.cpu_offloading",
                               "CPU offloading cannot be combined with activation recompute",
                               "turn off model.cpu_offloading or the recompute flags"))
        if getattr(model, "pipeline_model_parallel_size", 1) > 1:
            out.append(Finding("offload_with_pp", ERROR, "model.cpu_offloading",
                               "CPU offloading needs pipeline parallel size 1",
                               "set model.pipeline_model_parallel_size=1 or turn off model.cpu_offloading"))
    graphs = getattr(model, "cuda_graph_impl", "none") or "none"
    if granularity == "full" and graphs not in ("none", "full_iteration"):
        out.append(Finding("full_recompute_cuda_graphs", ERROR, "model.recompute_granularity",
                           f"full recompute with per-layer CUDA graphs ({graphs})",
                           "use cuda_graph_impl='full_iteration' or selective recompute"))
    if getattr(model, "distribute_saved_activations", False) and getattr(model, "sequence_parallel", False):
        out.append(Finding("distribute_saved_activations_sp", ERROR, "model.distribute_saved_activations",
                           "cannot be combined with sequence parallelism",
                           "set model.distribute_saved_activations=False"))
    return out


def doubling_findings(name: str, old: int, dp: int) -> list[Finding]:
    """Why ``name`` (``"PP"`` or ``"TP"``) cannot go from ``old`` to ``2 * old`` on the same GPUs (DP halves)."""
    problems = []
    if dp % 2:
        problems.append(Finding("needs_gpus", ERROR, "data parallel size", f"DP={dp} cannot be halved: "
                                f"{name} x 2 needs twice the GPUs", "add GPUs, or choose another lever"))
    if name == "TP" and 2 * old > MAX_TP:
        problems.append(Finding("tp_beyond_node", ERROR, "model.tensor_model_parallel_size",
                                f"TP={2 * old} spans more than one {MAX_TP}-GPU NVLink node",
                                f"keep TP <= {MAX_TP}"))
    return problems


def default_expert_tp(tp: int, ep: int) -> int:
    """The expert TP of a config that leaves it unset: 1 with EP > 1 (Bridge's provider ``finalize``,
    ``_set_moe_expert_tensor_parallel_default`` in ``megatron/bridge/models/transformer_config.py``), else TP
    (Megatron Core's ``ModelParallelConfig.__post_init__``)."""
    return 1 if ep > 1 else tp


def expert_sizes(model) -> tuple[int, int]:
    """EP and ETP of a model config as Megatron Core and Bridge fill them: EP 1 when unset, ETP by
    :func:`default_expert_tp` when unset (a finalized provider has it set already)."""
    tp = model.tensor_model_parallel_size
    ep = getattr(model, "expert_model_parallel_size", 1) or 1
    return ep, getattr(model, "expert_tensor_parallel_size", None) or default_expert_tp(tp, ep)


def expert_layout_problem(*, ep: int, etp, tp: int, cp: int, dp, experts, bias: bool = False, names: dict):
    """What Megatron Core refuses of an expert-parallel layout, as one finding, or None.

    Core's rules (Megatron Core 0.19): ``parallel_state.initialize_model_parallel`` makes the world
    TP x PP x CP x DP and refuses a world that ETP x EP x PP does not divide (the expert layers'
    grid; their DP is what is left), so TP x CP x DP must be a multiple of ETP x EP;
    ``transformer/moe/moe_layer.py`` ``BaseMoELayer.__init__`` asserts that EP divides the experts;
    ``TransformerConfig.__post_init__`` refuses EP > 1 without experts and, for MoE with
    ``add_bias_linear``, ETP other than 1. An unset ETP is :func:`default_expert_tp`. ``names`` maps ``ep``,
    ``etp`` and ``dp`` to the settings the user wrote; ``dp`` None leaves the grid rule to the check after the build.
    """
    if not etp:
        etp = default_expert_tp(tp, ep)
        etp_text = f"ETP={etp} (the default with EP{'>' if ep > 1 else '='}1)"
    else:
        etp_text = f"ETP={etp}"
    if ep > 1 and not experts:
        return _bad_input(names["ep"], f"EP={ep} needs a mixture-of-experts model, and this one has no experts",
                          f"drop {names['ep']} (or set it to 1)")
    if experts and experts % ep:
        fit = max(d for d in range(1, ep + 1) if experts % d == 0)
        return _bad_input(names["ep"],
                          f"EP={ep} does not divide the {experts} experts (each EP rank holds a whole share)",
                          f"choose an EP that divides {experts}, e.g. {_as_setting(names['ep'], fit)}")
    if experts and bias and etp > 1:
        return _bad_input(names["etp"], f"{etp_text} with biased linear layers (model.add_bias_linear): Megatron "
                                        "Core supports MoE bias only with ETP=1",
                          f"set {_as_setting(names['etp'], 1)}")
    grid = etp * ep
    if dp is None or (tp * cp * dp) % grid == 0:
        return None
    step = grid // math.gcd(tp * cp, grid)
    return _bad_input(names["dp"],
                      f"TP x CP x DP = {tp} x {cp} x {dp} = {tp * cp * dp} is not a multiple of ETP x EP = "
                      f"{etp} x {ep} = {grid} (each pipeline stage's GPUs must split into whole expert-parallel "
                      f"groups; {etp_text})",
                      f"make DP a multiple of {step}, e.g. {_as_setting(names['dp'], step * math.ceil(dp / step))}, "
                      "or choose a smaller EP or ETP")


def schedule_findings(*, pp: int, vpp: Optional[int], num_microbatches: int, group: Optional[int]) -> list[Finding]:
    """What Megatron Core refuses of a pipeline schedule for a step of ``num_microbatches`` microbatches.

    An interleaved schedule (VPP set) needs PP > 1 (``parallel_state.initialize_model_parallel`` L827-831,
    "pipeline-model-parallel size should be greater than 1 with interleaved schedule"); its microbatch group
    (``microbatch_group_size_per_vp_stage``, PP when unset: ``model_parallel_config.py`` L567-568) must lie in
    [PP, M] and leave a last group of 0 or at least PP microbatches (``pipeline_parallel/schedules.py`` L1133-1152,
    ``forward_backward_pipelining_with_interleaving``)."""
    if vpp is None:
        return []
    if pp <= 1:
        return [Finding("parallel_layout", ERROR, "model.virtual_pipeline_model_parallel_size",
                        f"is {vpp} with PP={pp}: Megatron Core refuses an interleaved schedule without pipeline "
                        "parallelism", "set model.pipeline_model_parallel_size > 1, or "
                                       "model.virtual_pipeline_model_parallel_size=null")]
    group = group or pp
    if not pp <= group <= num_microbatches:
        return [Finding("parallel_layout", ERROR, "train.global_batch_size",
                        f"gives {num_microbatches} microbatch(es) per step, and the interleaved schedule (PP={pp}, "
                        f"VPP={vpp}) runs them in groups of {group}, which Megatron Core requires to lie between PP "
                        f"and the microbatches", f"give a global batch of at least {group} microbatches per "
                                                  "data-parallel replica, or drop the interleaving")]
    last = num_microbatches % group
    if 0 < last < pp:
        return [Finding("parallel_layout", ERROR, "train.global_batch_size",
                        f"gives {num_microbatches} microbatches per step, leaving a last group of {last} (groups of "
                        f"{group}), fewer than PP={pp}: Megatron Core's interleaved schedule refuses it",
                        f"give a multiple of {group} microbatches per data-parallel replica")]
    return []


def _as_setting(name: str, value) -> str:
    return f"{name} {value}" if name.startswith("--") else f"{name}={value}"


def _bad_input(setting: str, message: str, fix: str) -> Finding:
    return Finding("bad_input", ERROR, setting, message, fix)


def query_group_problem(heads: int, groups: int, tp: int) -> Optional[str]:
    """Why TP cannot split the attention: it must divide the heads, and divide the query groups or be a multiple of
    them (Megatron Core ``transformer_config.py`` L1338-1345; with TP a multiple, each rank holds one key/value
    head); None when it can."""
    if heads % tp:
        return f"TP={tp} does not divide the {heads} attention heads"
    if groups % tp and tp % groups:
        return (f"TP={tp} neither divides the {groups} query groups nor is a multiple of them (transformer_config.py "
                "L1338-1345; with TP a multiple, Megatron Core gives each rank one key/value head)")
    return None


def moe_sequence_parallel_problem(*, experts, tp: int, sp: bool) -> Optional[str]:
    """Why an MoE model cannot train at this TP without sequence parallelism: ``MoELayer.forward`` raises in
    training whenever the attention's TP group is larger than 1 and SP is off (``moe/moe_layer.py`` L629-633),
    whatever the expert-parallel size; None when it can."""
    if experts and tp > 1 and not sp:
        return (f"is off with TP={tp} on an MoE model: Megatron Core's MoE layer refuses to train so "
                "(MoELayer.forward raises it, moe/moe_layer.py L629-633)")
    return None


def layout_findings(shape: dict, *, world: int, global_batch: int, tp: int, pp: int, vpp: Optional[int], cp: int,
                    ep: int, etp: int, dp: int, sp: bool, micro_batch: int) -> list[Finding]:
    """What Megatron Core and Bridge refuse of one parallel layout of a model of ``shape`` (``heads``,
    ``query_groups``, ``layers``, ``seq``, ``experts``, ``bias``) on ``world`` GPUs, one finding per broken rule:

    * TP x PP x CP x DP = world: ``parallel_state.initialize_model_parallel`` L822 (``world_size % model_size``);
    * TP divides the heads, and divides the query groups or is a multiple of them: :func:`query_group_problem`;
    * PP divides the layers: ``transformer_block.py`` L150-152; VPP divides a stage's layers (each chunk holds
      layers / (PP x VPP)): ``transformer_block.py`` L169-172; the interleaved schedule's rules: :func:`schedule_findings`;
    * CP: Bridge's ``training/config.py`` L1436, the sequence a multiple of 2 x CP;
    * SP needs TP > 1: ``model_parallel_config.py`` L502-504; MoE with TP > 1 needs SP:
      :func:`moe_sequence_parallel_problem`;
    * the expert layout: :func:`expert_layout_problem`;
    * micro-batch x DP divides the global batch: ``num_microbatches_calculator.py`` L381-387.
    """
    out = []

    def bad(setting, message, fix):
        out.append(_bad_input(setting, message, fix))

    if tp * pp * cp * dp != world:
        bad("--gpus", f"TP x PP x CP x DP = {tp * pp * cp * dp}, not the {world} GPUs", "choose sizes whose product is N")
    heads = query_group_problem(shape["heads"], shape["query_groups"], tp)
    if heads:
        bad("model.tensor_model_parallel_size", heads, "choose a divisor")
    uneven = uneven_split(shape["layers"], pp)
    if shape["layers"] % pp and (uneven is None or vpp is not None):
        bad("model.pipeline_model_parallel_size", f"PP={pp} does not divide the {shape['layers']} layers"
            + ("" if uneven is None else " (an uneven split is tried without interleaving)"), "choose a divisor")
    elif uneven is None and vpp is not None and (shape["layers"] // pp) % vpp:
        bad("model.virtual_pipeline_model_parallel_size",
            f"VPP={vpp} does not divide the {shape['layers'] // pp} layers of a stage", "choose a divisor")
    if cp > 1 and shape["seq"] % (2 * cp):
        bad("model.context_parallel_size", f"CP={cp} needs a sequence that is a multiple of {2 * cp}",
            "choose a smaller CP")
    if sp and tp == 1:
        bad("model.sequence_parallel", "needs TP > 1", "set model.sequence_parallel=false")
    moe_sp = moe_sequence_parallel_problem(experts=shape.get("experts"), tp=tp, sp=sp)
    if moe_sp:
        bad("model.sequence_parallel", moe_sp, "set model.sequence_parallel=true")
    problem = expert_layout_problem(ep=ep, etp=etp, tp=tp, cp=cp, dp=dp, experts=shape.get("experts"),
                                    bias=bool(shape.get("bias")), names=LAYOUT_NAMES)
    out += [problem] if problem else []
    if global_batch % (micro_batch * dp):
        bad("train.micro_batch_size", f"micro-batch {micro_batch} x DP {dp} does not divide the global batch "
            f"{global_batch}", "choose a micro-batch dividing global batch / DP")
    elif pp > 1:
        out += schedule_findings(pp=pp, vpp=vpp, num_microbatches=global_batch // (micro_batch * dp), group=None)
    return out


LAYOUT_NAMES = {"ep": "model.expert_model_parallel_size", "etp": "model.expert_tensor_parallel_size",
                "dp": "data parallel size"}
"""The settings :func:`layout_findings` names in the expert rules."""


def uneven_split(layers: int, pp: int) -> Optional[tuple[int, int]]:
    """Layers of the first and the last stage when ``pp`` does not divide ``layers``: the middle stages hold
    ceil(layers / pp) each and the first and last share the rest (Core requires the middle layers to divide over
    the middle stages, ``transformer_config.py`` L2043-2047); None when ``pp`` divides them or no split exists."""
    if layers % pp == 0 or pp < 3:
        return None
    per = -(-layers // pp)
    rest = layers - (pp - 2) * per
    first = rest // 2
    return (first, rest - first) if 1 <= first and rest - first <= per else None
