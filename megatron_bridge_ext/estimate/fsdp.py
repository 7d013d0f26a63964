"""Megatron-FSDP's memory on one rank: its sharded buffers and the unsharded buckets alive in forward and backward.

Megatron Core 0.19.2's ``ParamAndGradBuffer`` (``distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py``)
groups the rank's parameters (``_get_parameter_groups`` L1726-1957: one group per FSDP unit, a transformer, MoE or
Mamba layer under ``optim_grads_params`` (``mcore_fsdp_adapter.py`` L158-164), split by dtype, expert and
``requires_grad``, and by ``ddp.bucket_size`` elements outside the units), lays each group out padded to a multiple of
DP x its chunk size (``build_data_parallel_buffer_index`` L257-382, ``_pad_if_needed`` L284-287, not padded under
``no_shard``) and keeps, per group (L2645-2728):

* **model weights**: under ``no_shard`` the module's own parameters; else a buffer of the parameter dtype, sharded
  over DP under ``optim_grads_params`` and whole otherwise (L2645-2663);
* **main weights**: with ``ddp.megatron_fsdp_main_params_dtype`` (fp32 by default; None: none), for trainable
  groups, sharded except under ``no_shard`` (L2683-2699). They are the optimizer's parameters
  (``_init_optimizer_named_parameters`` L3287-3341): Adam's moments follow them, one per element of the rank's shard
  (torch's Adam in the parameters' dtype; Transformer Engine's FusedAdam in ``exp_avg_dtype``/``exp_avg_sq_dtype``,
  with no master copy of its own: Core turns ``master_weights`` off, ``optimizer/__init__.py`` L1116-1128);
* **main gradients**: ``megatron_fsdp_main_grads_dtype`` or the parameter dtype (``_resolve_group_grad_dtype``
  L2306-2315: ``grad_reduce_in_fp32`` is not read), sharded under ``optim_grads`` and ``optim_grads_params``.

Buckets alive around the compute, with sharded gradients or parameters:

* **parameter all-gathers** (``optim_grads_params``): a unit's whole bucket, allocated before its forward and freed
  after it (``megatron_fsdp.py`` L780-800, L956-977), the same in backward; ``AllGatherPipeline.all_gather_params``
  (L4380-4520) prefetches the next units until the prefetched elements reach ``suggested_AG_prefetch_size``, half
  of ``ddp.suggested_communication_unit_size`` (default: twice a unit's mean elements, at least 10^9 elements,
  ``megatron_fsdp.py`` L419-444). Buckets outside the units stay gathered (``AllGatherPipeline.reset`` L4331-4378);
* **gradient reduce-scatters** (``optim_grads``, ``optim_grads_params``): each bucket's whole gradient is allocated
  when its first gradient arrives (``main_grad_getter`` L3086-3115, in ``megatron_fsdp_grad_comm_dtype`` when set),
  reduce-scattered, and freed only when ``wait_for_previous_grad_reduce`` pops it from the queue, which it does while
  the queue holds more than ``suggested_communication_unit_size`` elements (L3916-3946, L4219-4249).

Not modelled: a unit gathered again for activation recompute is released lazily (``megatron_fsdp.py`` L956-967), and
a stage's model chunks (VPP) are laid out as one model (each chunk's buffers differ only outside the units).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.estimate.report import BUFFERS, STATIC, Component
from megatron_bridge_ext.levers import fsdp as rules

UNITS = "Megatron-FSDP unsharded buckets in flight"
"""The forward/backward buffers: gone before the optimizer step (:func:`.phases.phases` leaves them out of it)."""
NON_UNITS = "Megatron-FSDP gathered parameters outside the units"
MIN_COMMUNICATION_UNIT = 1_000_000_000
"""Core's floor of the default ``suggested_communication_unit_size`` in elements (``megatron_fsdp.py`` L438-441)."""


@dataclass(frozen=True)
class Bucket:
    """One of Core's parameter groups on this rank: its elements laid out (``size``, padded), its shard, the real
    elements of rank 0's shard (the optimizer's), whether it is trainable, an FSDP unit's, and how many times the
    rank holds it (a reduced stage's layer stands for ``copies`` layers)."""

    size: int
    shard: int
    rank0_elements: int
    elements: int
    trainable: bool
    unit: Optional[int]
    copies: int = 1


def buckets(model, ddp, *, dp: int, expert_dp: int, sources: Optional[list[int]] = None) -> list[Bucket]:
    """Core's own grouping and layout of ``model``'s parameters (``_get_parameter_groups``,
    ``build_data_parallel_buffer_index``), on rank 0 of the DP x CP group (the experts' expert-DP group). Kept on the
    model for the same DDP config, sizes and sources: a search estimates one traced model under many data-parallel
    sizes (:mod:`.trace_cache`)."""
    kept = model.__dict__.setdefault("_mbx_fsdp_buckets", {})
    key = (repr(ddp), dp, expert_dp, None if sources is None else tuple(sources))
    if key not in kept:
        kept[key] = _buckets(model, ddp, dp=dp, expert_dp=expert_dp, sources=sources)
    return kept[key]


def _buckets(model, ddp, *, dp: int, expert_dp: int, sources: Optional[list[int]]) -> list[Bucket]:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as core

    units = _unit_modules(rules.strategy(ddp))
    policy = core.BucketingPolicy(suggested_bucket_size=getattr(ddp, "bucket_size", None), fsdp_unit_modules=units,
                                  data_parallel_sharding_strategy=rules.strategy(ddp))
    whole = model if units or not sources else _WholeStage(model, sources)
    groups, _, _ = core._get_parameter_groups(whole, policy, {})
    names = {id(p): n for n, p in model.named_parameters()}  # a repeated tensor has its built layer's name
    out = []
    for index, group in enumerate(groups):
        world = expert_dp if group.is_expert_param else dp
        items, bucket, shard = core.build_data_parallel_buffer_index(
            [p.shape for p in group.params], 0, world, world > 1, ddp, bucket_id=index,
            chunk_size_factor=group.chunk_size_factor)
        rank0 = sum(max(0, min(i.global_data_index + i.size, shard.size) - i.global_data_index)
                    for i in items.values())
        layer = _layer(names[id(group.params[0])])
        copies = sources.count(layer) if sources and layer is not None and group.fsdp_unit_id is not None else 1
        out.append(Bucket(bucket.size, shard.size, rank0, sum(p.numel() for p in group.params),
                          bool(group.requires_grad), group.fsdp_unit_id, copies))
    return out


class _WholeStage:
    """A reduced stage's parameters as the whole stage has them, for Core's grouping where no unit splits the layers:
    the built layer ``sources[i]``'s parameters stand for layer i (the same tensors, repeated)."""

    def __init__(self, model, sources: list[int]):
        self.model, self.sources = model, sources

    def named_parameters(self):
        named = list(self.model.named_parameters())
        by_layer: dict[int, list] = {}
        for name, param in named:
            layer = _layer(name)
            if layer is not None:
                by_layer.setdefault(layer, []).append((name, param))
        first = next(i for i, (name, _) in enumerate(named) if _layer(name) is not None)
        after = [item for item in named[first:] if _layer(item[0]) is None]
        return iter(named[:first] + [item for source in self.sources for item in by_layer[source]] + after)


def _unit_modules(name: str) -> list:
    """Core's FSDP units: transformer, MoE and Mamba layers under ``optim_grads_params``, none otherwise
    (``mcore_fsdp_adapter.py`` L158-164)."""
    if name != "optim_grads_params":
        return []
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    return [TransformerLayer, MoETransformerLayer, MambaLayer]


def _layer(name: str) -> Optional[int]:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and i and parts[i - 1] == "decoder" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


@dataclass(frozen=True)
class Layout:
    """The rank's Megatron-FSDP bytes by buffer (see the module docstring), and its optimizer's elements."""

    strategy: str
    weights: int
    mains: int
    grads: int
    optimizer_elements: int
    gathered_outside_units: int
    in_flight: int
    in_flight_basis: str


def dtype_sizes(ddp, param_bytes: int) -> tuple[int, int, int]:
    """Bytes per element of the main weights (0: none), the main gradients, and the gradient buckets of the
    reduce-scatter (``mcore_fsdp_adapter.py`` L134-138, ``MixedPrecisionPolicy``)."""
    from megatron_bridge_ext.estimate.static import dtype_bytes

    main = getattr(ddp, "megatron_fsdp_main_params_dtype", None)
    grad = getattr(ddp, "megatron_fsdp_main_grads_dtype", None)
    comm = getattr(ddp, "megatron_fsdp_grad_comm_dtype", None)
    grad_bytes = dtype_bytes(grad) if grad is not None else param_bytes
    return (dtype_bytes(main) if main is not None else 0, grad_bytes,
            dtype_bytes(comm) if comm is not None else grad_bytes)


def layout(groups: list[Bucket], ddp, *, param_bytes: int) -> Layout:
    """The persistent buffers of ``groups`` under the config's strategy and dtypes, and the buckets in flight."""
    name = rules.strategy(ddp)
    main_bytes, grad_bytes, comm_bytes = dtype_sizes(ddp, param_bytes)
    sharded = {"weights": name == "optim_grads_params", "mains": name != "no_shard",
               "grads": name in ("optim_grads", "optim_grads_params")}

    def held(kind: str, g: Bucket) -> int:
        return g.copies * (g.shard if sharded[kind] else g.size)

    weights = sum(g.copies * g.elements for g in groups) if name == "no_shard" else \
        sum(held("weights", g) for g in groups)
    trainable = [g for g in groups if g.trainable]
    optimizer = sum(g.copies * (g.rank0_elements if sharded["mains"] else g.elements) for g in trainable)
    outside = sum(g.size for g in groups if g.unit is None) if sharded["weights"] else 0
    in_flight, basis = _in_flight(groups, ddp, param_bytes=param_bytes, comm_bytes=comm_bytes, sharded=sharded)
    return Layout(name, weights * param_bytes, sum(held("mains", g) for g in trainable) * main_bytes,
                  sum(held("grads", g) for g in trainable) * grad_bytes, optimizer, outside * param_bytes,
                  in_flight, basis)


def communication_unit(groups: list[Bucket], ddp) -> int:
    """``suggested_communication_unit_size`` as ``MegatronFSDP`` sets it (``megatron_fsdp.py`` L419-441)."""
    given = getattr(ddp, "suggested_communication_unit_size", None)
    if given is not None:
        return given
    units = _unit_sizes(groups, whole=True)
    if units:
        return max(MIN_COMMUNICATION_UNIT, sum(units) // len(units) * 2)
    return max(MIN_COMMUNICATION_UNIT, getattr(ddp, "bucket_size", None) or MIN_COMMUNICATION_UNIT)


def _unit_sizes(groups: list[Bucket], *, whole: bool = False) -> list[int]:
    """Each unit's laid-out elements (``whole``: its parameters' own), one entry per layer the rank holds."""
    sizes: dict[int, int] = {}
    copies: dict[int, int] = {}
    for g in groups:
        if g.unit is not None:
            sizes[g.unit] = sizes.get(g.unit, 0) + (g.elements if whole else g.size)
            copies[g.unit] = g.copies
    return [size for unit, size in sizes.items() for _ in range(copies[unit])]


def gathered_window(units: list[int], prefetch: int) -> int:
    """The most elements of gathered units alive at once: a unit and those prefetched after it until the prefetched
    elements reach ``prefetch`` (``all_gather_params`` L4481-4507); the earlier unit is freed after its forward."""
    best = 0
    for i, size in enumerate(units):
        fetched, j = 0, i + 1
        while j < len(units) and fetched < prefetch:
            fetched += units[j]
            j += 1
        best = max(best, size + fetched)
    return best


def reduce_window(buckets_in_order: list[int], capacity: int) -> int:
    """The most gradient-bucket elements alive at once in backward: the queue of reduce-scatters not yet popped plus
    the bucket being filled; the queue is trimmed to ``capacity`` elements before each new one joins it
    (``wait_for_previous_grad_reduce`` L3916-3946)."""
    queue: list[int] = []
    best = 0
    for size in buckets_in_order:
        best = max(best, sum(queue) + size)
        while sum(queue) > capacity:
            queue.pop(0)
        queue.append(size)
    return best


def _in_flight(groups, ddp, *, param_bytes: int, comm_bytes: int, sharded: dict) -> tuple[int, str]:
    """Backward's unsharded buckets: the gathered units (``optim_grads_params``), the trainable buckets outside the
    units (filled from the output layer's gradient to the embedding's, reduced last: alive all backward) and the
    units' gradient buckets in the reduce-scatter queue."""
    if not sharded["grads"]:
        return 0, ""
    capacity = communication_unit(groups, ddp)
    params = gathered_window(_unit_sizes(groups)[::-1], capacity // 2) if sharded["weights"] else 0
    outside = sum(g.copies * g.size for g in groups if g.trainable and g.unit is None)
    grads = outside + reduce_window(_unit_sizes([g for g in groups if g.trainable])[::-1], capacity)
    basis = (f"formula: backward holds {params:,} gathered parameter elements x {param_bytes} B (a unit and its "
             f"prefetch up to {capacity // 2:,} elements) + {grads:,} gradient-bucket elements x {comm_bytes} B "
             f"({outside:,} outside the units, alive until the end of backward, and the units' reduce-scatter queue "
             f"up to {capacity:,} elements with the bucket being filled): Megatron Core param_and_grad_buffer.py "
             "L3086-3115, L3916-3946, L4380-4520; megatron_fsdp.py L419-444")
    return params * param_bytes + grads * comm_bytes, basis


def static_components(lay: Layout, *, optimizer_states: int, optimizer_basis: str) -> list[Component]:
    """The rank's Megatron-FSDP lines: model weights, main gradients, the optimizer states (its main weights and
    moments, ``optimizer_states`` bytes), the parameters kept gathered outside the units, the buckets in flight."""
    where = {"no_shard": "whole", "optim": "whole", "optim_grads": "whole", "optim_grads_params": "DP shard"}
    out = [Component(STATIC, "weights: Megatron-FSDP model weights", lay.weights,
                     f"{where[lay.strategy]} of the parameters ({lay.strategy}; param_and_grad_buffer.py L2645-2663)"),
           Component(STATIC, "gradients (Megatron-FSDP main gradients)", lay.grads,
                     f"{'DP shard' if lay.strategy in ('optim_grads', 'optim_grads_params') else 'whole'} of the "
                     f"trainable parameters' gradients ({lay.strategy}; param_and_grad_buffer.py L2701-2728)"),
           Component(STATIC, "optimizer states", optimizer_states, optimizer_basis)]
    if lay.gathered_outside_units:
        out.append(Component(BUFFERS, NON_UNITS, lay.gathered_outside_units,
                             "formula: embedding, output layer and final norm buckets stay gathered between "
                             "iterations (AllGatherPipeline.reset, param_and_grad_buffer.py L4331-4378)"))
    if lay.in_flight:
        out.append(Component(BUFFERS, UNITS, lay.in_flight, lay.in_flight_basis))
    return out


def moment_bytes(optimizer, ddp, *, param_bytes: int) -> tuple[int, int]:
    """Bytes of Adam's two moments per element: the precision-aware optimizer's ``exp_avg_dtype``/``exp_avg_sq_dtype``
    (TE's FusedAdam), else the dtype of the parameters the optimizer steps, Megatron-FSDP's main weights (the
    parameter dtype without them): torch's Adam and FusedAdam make them ``zeros_like`` the parameter."""
    import torch

    from megatron_bridge_ext.estimate.static import state_bytes

    if getattr(optimizer, "use_precision_aware_optimizer", False):
        return tuple(state_bytes(getattr(optimizer, name, torch.float32)) for name in ("exp_avg_dtype",
                                                                                       "exp_avg_sq_dtype"))
    own = dtype_sizes(ddp, param_bytes)[0] or param_bytes
    return own, own


def step_state(optimizer, ddp, lay: Layout, *, param_bytes: int):
    """What the optimizer holds and allocates around its step over Megatron-FSDP's shard (:class:`.phases.StepState`):
    the main weights exist from construction, the moments from the first step; the step's transients:

    * without the decoupled gradient (no precision-aware optimizer), ``update_main_grads`` casts each gradient item to
      the main weights' dtype (``param_and_grad_buffer.py`` L3369-3373) and keeps it in ``dist_main_grad`` until
      the next step's: a copy where the dtypes differ;
    * FusedAdam unscales 16-bit moments to fp32 for its kernel (as without FSDP, :func:`.phases.step_state`).
    """
    from megatron_bridge_ext.estimate import phases
    from megatron_bridge_ext.estimate.report import TRANSIENT

    main_bytes, grad_bytes, _ = dtype_sizes(ddp, param_bytes)
    moments = moment_bytes(optimizer, ddp, param_bytes=param_bytes)
    elements = lay.optimizer_elements
    transients, kept = [], []
    decoupled = getattr(ddp, "megatron_fsdp_use_decoupled_grad", False)
    if main_bytes and not decoupled and grad_bytes != main_bytes:
        transients.append(Component(
            TRANSIENT, phases.FP32_GRAD_COPIES, elements * main_bytes,
            f"formula: {elements:,} elements of the optimizer's shard x {main_bytes} B: the {grad_bytes}-byte main "
            "gradients cast to the main weights' dtype (Megatron-FSDP param_and_grad_buffer.py L3369-3373), kept in "
            "dist_main_grad until the next step"))
        kept.append(phases.FP32_GRAD_COPIES)
    low = phases.unscaled_states(optimizer, with_masters=False) \
        if getattr(optimizer, "use_precision_aware_optimizer", False) else []
    if low:
        transients.append(phases.unscaled_component(elements, low))
    return phases.StepState(lay.mains, elements * sum(moments), False, tuple(transients), tuple(kept), (),
                            elements, 0, None)


def optimizer_basis(optimizer, ddp, lay: Layout, *, param_bytes: int) -> str:
    main_bytes = dtype_sizes(ddp, param_bytes)[0]
    moments = moment_bytes(optimizer, ddp, param_bytes=param_bytes)
    where = "whole" if lay.strategy == "no_shard" else "rank 0's DP shard"
    return (f"Megatron-FSDP main weights {lay.mains:,} B ({main_bytes} B per element, {where}; "
            f"param_and_grad_buffer.py L2683-2699) + Adam moments {lay.optimizer_elements:,} elements x "
            f"({' + '.join(map(str, moments))}) B (the optimizer's parameters are the main-weight shards, L3287-3341; "
            "no FusedAdam master copy, optimizer/__init__.py L1116-1128)")
