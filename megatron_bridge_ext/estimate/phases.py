"""A run's memory by phase: a resumed run's optimizer-state load, iteration 1 before the optimizer's moments exist (a
fresh run), the first step, the steady state, and with CUDA graphs the steady state once they are captured.

The steady-state estimate (:mod:`.memory`) holds every component at once. A Megatron run reaches it in steps,
and the figures users compare come from different ones:

* **resume** (a run that loads optimizer state, :func:`load_transients`): weights, the gradient buffer and every
  optimizer state, with the load's own transients; iteration 1 then holds the loaded moments;
* **iteration 1, forward and backward**: weights, the gradient buffer, the fp32 main copies (Megatron Core's
  optimizers make them at construction: ``distrib_optimizer.py`` L445 ``shard_main_param =
  shard_model_param.clone().float()``), activations in flight, no moments: torch's Adam creates ``exp_avg`` and
  ``exp_avg_sq`` in its first ``step()`` (torch 2.14 ``optim/adam.py`` L162-185, ``_init_group``: ``if len(state)
  == 0``), and so does Transformer Engine's FusedAdam (``optimizers/fused_adam.py``, ``FusedAdam.step``: "State
  initialization", ``if len(state) == 0: self.initialize_state(p, ...)``), which with the precision-aware
  optimizer also creates its master weights there (``initialize_state``: ``master_param`` when
  ``master_weights``, Core passes ``master_weights=True``, ``optimizer/__init__.py`` L574-580);
* **the first optimizer step**: the moments exist, activations are freed, and the step allocates its own
  transients, alive together: without the precision-aware optimizer, a bf16 gradient buffer's shard is copied
  to fp32 for the main parameters (``distrib_optimizer.py`` L2782 ``shard_main_param.grad =
  shard_model_grad.float()``; ``optimizer.py`` L1097 for the non-distributed optimizer; a fp32 buffer's
  ``.float()`` returns the same tensor), kept until the next ``zero_grad``; with it and 16-bit states, FusedAdam
  unscales every state of a parameter group to fp32 before its kernel runs (``FusedAdam.step``, "Unscaling":
  ``get_unscaled_state`` returns ``state.float()`` for a bf16 or fp16 state and keeps it in ``unscaled_lists``
  for the group). The parameter all-gather of the distributed optimizer writes into the parameter buffer in
  place, with or without ``overlap_param_gather`` (``distributed/param_and_grad_buffer.py`` L500-519,
  ``all_gather_into_tensor(bucket.param_data, local_data_view)``), and the gradient norm and clipping work on
  the main gradients in place (``optimizer/clip_grads.py`` L55-140: a few fp32 scalars), so neither adds a line;
* **the steady state** (iteration 2 on): moments and a step's activations together (:mod:`.memory`'s peak);
* **CUDA-graph capture**: Bridge captures TE's graphs once ``cuda_graph_warmup_steps`` iterations are done
  (``training/train.py`` L429-441; Core's local graphs are recorded and created after as many warmup steps), so
  from the iteration after the steady state holds the static buffers the graphs keep too (:mod:`.cuda_graphs`:
  TE's static inputs per the schedule's reuse, one set of output gradients, the last input gradient; the local
  runners' clones of eager inputs); their pool's intermediates are the traced activations, allocated there instead.

Each phase's peak is its live components plus its transients (the largest one for forward/backward, whose
transients come one after another; their sum for the step, whose copies are alive together).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bridge_ext.estimate.fsdp import UNITS as FSDP_UNITS
from megatron_bridge_ext.estimate.features.activation_offload import KEPT as OFFLOAD_KEPT
from megatron_bridge_ext.estimate.report import ACTIVATIONS, BUFFERS, STATIC, TRANSIENT, Component
from megatron_bridge_ext.estimate.settings import Settings

RESUME = "resume: optimizer state loaded"
ITERATION_1 = "iteration 1 forward/backward"
FIRST_STEP = "first optimizer step"
STEADY = "steady state"
CUDA_GRAPHS = "CUDA-graph capture"
OPTIMIZER_STATES = "optimizer states"
FP32_GRAD_COPIES = "fp32 gradient-shard copies (optimizer step)"
UNSCALED_STATES = "fp32 unscaled optimizer states (FusedAdam step)"
RELOADED_STATES = "optimizer states re-made by FusedAdam.load_state_dict"
DUMMY_STEP_GRADS = "random gradients of the hybrid optimizer's dummy step"
HOST_STATES_ON_GPU = "host optimizer states moved to the GPU while loading"


@dataclass(frozen=True)
class StepState:
    """What the rank's optimizer holds and allocates around its step.

    ``masters``/``moments``: bytes of the main copies and of the moments (their sum is the ``optimizer states``
    line); ``masters_in_step``: the main copies are created in the first step too (the precision-aware
    optimizer's, held by FusedAdam); ``transients``: the step's own allocations, alive together;
    ``kept``: those of them still alive when Bridge reports memory after the step (the fp32 gradient copies,
    freed at the next ``zero_grad``); ``notes``: the step's settings that add nothing, with where it is read.
    """

    masters: int
    moments: int
    masters_in_step: bool
    transients: tuple[Component, ...] = ()
    kept: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    elements: int = 0
    offloaded: int = 0
    """The shard's elements, and those whose state the CPU-offload optimizer keeps on the host."""
    load: Optional[tuple[Component, ...]] = None
    """The transients of loading the optimizer state from a checkpoint (one after another); None: a fresh run."""


@dataclass(frozen=True)
class Phase:
    """One phase of a run: its live components, its peak, and the components alive when it ends."""

    name: str
    components: tuple[Component, ...]
    peak_bytes: int
    after_bytes: int
    basis: str

    def as_dict(self) -> dict:
        return {"name": self.name, "peak_bytes": self.peak_bytes, "after_bytes": self.after_bytes,
                "basis": self.basis, "components": [vars(c) for c in self.components]}


def step_state(optimizer, shard, rule, *, grad_bytes: int, ddp=None, resume: bool = False) -> StepState:
    """The step of Megatron Core's optimizer for one rank's shard (``static.OptimizerShard``) under ``rule``;
    ``resume``: the run loads its optimizer state from a checkpoint first (:func:`load_transients`)."""
    transients = []
    kept = []
    # the offload's hybrid optimizer makes its main copies at construction (hybrid_optimizer.py L277-279)
    fused_adam_masters = rule.precision_aware and rule.offload_fraction is None and te_holds_masters(optimizer)
    if not rule.precision_aware and 0 < grad_bytes < 4 and rule.main_bytes:
        transients.append(Component(
            TRANSIENT, FP32_GRAD_COPIES, shard.elements * 4,
            f"formula: {shard.elements:,} elements of the rank's gradient shard x 4 B: the {grad_bytes}-byte gradient "
            "buffer's shard cast to fp32 for the main parameters (Megatron Core distrib_optimizer.py L2782 "
            "shard_main_param.grad = shard_model_grad.float(); optimizer.py L1097 without the distributed "
            "optimizer); kept until the next zero_grad"))
        kept.append(FP32_GRAD_COPIES)
    low = unscaled_states(optimizer, with_masters=fused_adam_masters and bool(rule.main_bytes) and not rule.remainders)
    if rule.precision_aware and low:
        transients.append(unscaled_component(shard.elements, low))
    notes = _step_notes(optimizer, ddp)
    return StepState(shard.masters, shard.moments, fused_adam_masters, tuple(transients), tuple(kept), notes,
                     shard.elements, shard.offloaded,
                     load_transients(optimizer, shard, rule, fused_adam_masters) if resume else None)


def load_transients(optimizer, shard, rule, fused_adam_masters: bool) -> tuple[Component, ...]:
    """What loading a distributed optimizer's state allocates beyond the states themselves (Core 0.19, Bridge 0.6).

    Bridge builds the optimizer's sharded state dict for loading (``checkpointing.py`` L2787-2836: unless
    ``finetune`` or ``load_optim=False``; ``optimizer.sharded_state_dict(..., is_loading=True)``), which first
    loads the optimizer's own state dict into it (``distrib_optimizer.py`` L1554) so that the states exist: with none yet, ``load_state_dict`` allocates one
    ``torch.empty`` shard per state in its dtype (L974-1014: the moments, and the master copy where FusedAdam holds
    it) and hands them to the inner optimizer (L1046-1048); the checkpoint's tensors are then read into those
    (``_set_main_param_and_optimizer_states``, L1193-1225, ``copy_``). The model and the gradient buffer exist; no
    activations. What comes on top, one after another:

    * torch's Adam adopts the scaffold (its ``load_state_dict`` casts with ``.to``, the same tensor when dtype and
      device match), and so does TE's FusedAdam under Bridge's ``memory_efficient_fp32_optimizer_state_loading``
      (``training/optim.py`` L142-241, used by ``setup.py`` L406-408) for fp32 states without the precision-aware
      optimizer: nothing;
    * with the precision-aware optimizer Bridge leaves FusedAdam's own loader (optim.py L184-185), which makes every
      state anew (``FusedAdam.load_state_dict``: ``set_scaled_state`` -> ``_initialize_state``) while the caller still
      holds the scaffold: the states twice;
    * with CPU offload the hybrid optimizer first takes a dummy step (``distrib_optimizer.py`` L928-929;
      ``hybrid_optimizer.py`` L453-463: a ``randn_like`` gradient for each of its parameters), then torch's
      ``Optimizer.load_state_dict`` casts every state to its parameter's device, the GPU main shard's, so the host
      part's moments and main copies (``master_param``, L319-320) come to the GPU until the post-load hook moves them
      back (L417-436, ``_move_new_state_to_right_device`` L357-367).
    """
    if rule.offload_fraction is not None:
        per_grad = 2 if rule.precision_aware else 4  # the 16-bit shard or the fp32 main shard (offload.py)
        host = shard.offloaded * (sum(rule.moment_bytes) + 4)
        return (Component(TRANSIENT, DUMMY_STEP_GRADS, shard.elements * per_grad,
                          f"formula: {shard.elements:,} shard elements x {per_grad} B (hybrid_optimizer.py L453-463, "
                          "distrib_optimizer.py L928-929)"),
                Component(TRANSIENT, HOST_STATES_ON_GPU, host,
                          f"formula: {shard.offloaded:,} host elements x ({' + '.join(map(str, rule.moment_bytes))} "
                          "moments + 4 fp32 main copy) B: torch's Optimizer.load_state_dict casts them to the GPU "
                          "parameter's device (hybrid_optimizer.py L319-320, L357-367, L417-436)"))
    if rule.precision_aware:
        again = shard.moments + (shard.masters if fused_adam_masters else 0)
        return (Component(TRANSIENT, RELOADED_STATES, again,
                          f"formula: the rank's {again:,} B of FusedAdam states made anew while the loading scaffold "
                          "is held (distrib_optimizer.py L974-1014, L1046-1048; FusedAdam.load_state_dict)"),)
    return ()


def te_holds_masters(optimizer) -> bool:
    """Core's ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` (optimizer_config.py L404-411): FusedAdam keeps
    the master weights (``master_weights=True``) unless FP8 parameters of a non-delayed recipe keep them in Core."""
    if not getattr(optimizer, "use_precision_aware_optimizer", False):
        return False
    import torch

    recipe = getattr(optimizer, "fp8_recipe", None)
    return (getattr(optimizer, "main_params_dtype", torch.float32) != torch.float32 or recipe in (None, "delayed")
            or bool(getattr(optimizer, "optimizer_cpu_offload", False)))


def unscaled_states(optimizer, *, with_masters: bool) -> list[str]:
    """The precision-aware optimizer's states that Transformer Engine's ``FusedAdam.step`` copies to fp32 for its
    kernel (``get_unscaled_state``, TE v2.17.1 ``pytorch/optimizers/fused_adam.py`` L306-352, called at L666-671):
    fp16 and FP8 (``torch.uint8``) states always (``.float()``); bf16 ones unless both moments are bf16, where TE
    v2.14 and later fuse their unscaling into the kernel and pass them as they are (``fuse_unscale``, L218-220,
    ``skip_unscale``; commit 459e7cf4, "Fuse scaling and unscaling of bf16 momentums into kernels", #2632). fp32
    states are used in place. ``with_masters``: FusedAdam holds the master weights (remainders are read as they are)."""
    dtypes = {"exp_avg": getattr(optimizer, "exp_avg_dtype", torch.float32),
              "exp_avg_sq": getattr(optimizer, "exp_avg_sq_dtype", torch.float32)}
    if with_masters:
        dtypes["master_param"] = getattr(optimizer, "main_params_dtype", torch.float32)
    fused = dtypes["exp_avg"] == dtypes["exp_avg_sq"] == torch.bfloat16
    return [name for name, dtype in dtypes.items()
            if dtype in (torch.float16, torch.uint8) or (dtype == torch.bfloat16 and not fused)]


def unscaled_component(elements: int, names: list[str]) -> Component:
    """The step's fp32 copies of the states :func:`unscaled_states` names, for ``elements`` elements of a shard."""
    return Component(
        TRANSIENT, UNSCALED_STATES, elements * 4 * len(names),
        f"formula: {elements:,} elements x 4 B x {len(names)} ({', '.join(names)}): Transformer Engine's "
        "FusedAdam.step copies each such state to fp32 (get_unscaled_state: state.float()) and keeps the copies of a "
        "parameter group for its kernel (bf16 moments together are unscaled inside the kernel since TE v2.14)")


def _step_notes(optimizer, ddp) -> tuple[str, ...]:
    """``ddp.overlap_param_gather`` and ``optimizer.overlap_param_gather_with_optimizer_step`` (Core's
    optimizer/__init__.py L1049-1054 overlaps the first chunk's gather with the step), read and stated."""
    out = []
    for config, name in ((ddp, "overlap_param_gather"), (optimizer, "overlap_param_gather_with_optimizer_step")):
        if getattr(config, name, False):
            out.append(f"{name}: the parameter all-gather writes into the parameter buffer in place "
                       "(param_and_grad_buffer.py L500-519), no extra bytes")
    return tuple(out)


def phases(est) -> list[Phase]:
    """The phases of ``est`` (a :class:`~.report.MemoryEstimate` with its ``step``), in the order a run meets them;
    without ``step`` (an estimate made before phases existed), the steady state alone."""
    steady = _phase(STEADY, est.components, est.step, transients_together=False,
                    basis="static + activations + buffers + largest transient (moments and activations together)")
    if est.step is None:
        return [steady]
    live = [c for c in est.components if c.kind in (STATIC, BUFFERS) and not _forward_backward_only(c)]
    step = _phase(FIRST_STEP, live + list(est.step.transients), est.step, transients_together=True,
                  basis="static with the moments + buffers + the step's transients (alive together); activations "
                        "freed" + "".join(f"; {n}" for n in est.step.notes))
    if est.step.load is not None:
        resume = _phase(RESUME, live + list(est.step.load), None, transients_together=False,
                        basis="static with the loaded optimizer states + buffers + the largest of the load's "
                              "transients; no activations (estimate.phases.load_transients)")
        iteration_1 = _phase(ITERATION_1, _warmup(est.components), est.step, transients_together=False,
                             basis="static with the loaded moments + activations + buffers + largest transient")
        return [resume, iteration_1, step, steady] + _graphs(est)
    first = [_without_moments(c, est.step) if c.name == OPTIMIZER_STATES else c for c in _warmup(est.components)]
    iteration_1 = _phase(ITERATION_1, first, est.step, transients_together=False,
                         basis="static without the moments (created in the first step) + activations + buffers "
                               "+ largest transient")
    return [iteration_1, step, steady] + _graphs(est)


def _graphs(est) -> list[Phase]:
    """The steady state with the captured graphs' static buffers, when the config captures per-layer graphs."""
    buffers = getattr(est, "graph_buffers", None)
    if buffers is None:
        return []
    return [_phase(CUDA_GRAPHS, list(est.components) + [buffers], est.step, transients_together=False,
                   basis="the steady state + the static buffers the captured graphs hold; their pool's "
                         "intermediates are the activations above (estimate.cuda_graphs)")]


@dataclass(frozen=True)
class GraphPool:
    """The capture phase's prediction of one stage's CUDA-graph private pool (:mod:`.cuda_graphs`): the captured
    graphs' static buffers (an upper bound) and the captured regions' intermediates, which a replay allocates in the
    pool: the activations in flight, counted whole (the embedding's and the loss's, run outside the graphs, too); the
    regions' transients are not counted."""

    static_bytes: int
    intermediate_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.intermediate_bytes


def graph_pool(est) -> Optional[GraphPool]:
    """The pool :class:`GraphPool` predicts for ``est``, None without per-layer graphs (no capture phase)."""
    buffers = getattr(est, "graph_buffers", None)
    return None if buffers is None else GraphPool(buffers.bytes, est.total(ACTIVATIONS))


def _warmup(components) -> list[Component]:
    """Iteration 1's components: the activation offload's warmup offloads every group
    (fine_grained_activation_offload.py L1066-1087, ``should_bulk_offload``), so what it keeps from iteration 2 on is
    not held yet."""
    return [c for c in components if c.name != OFFLOAD_KEPT]


def _phase(name: str, components, step: Optional[StepState], *, transients_together: bool, basis: str) -> Phase:
    components = tuple(components)
    transients = [c.bytes for c in components if c.kind == TRANSIENT]
    held = sum(c.bytes for c in components if c.kind != TRANSIENT)
    peak = held + (sum(transients) if transients_together else max(transients, default=0))
    kept = set(step.kept) if step else set()
    after = sum(c.bytes for c in components if c.kind in (STATIC, BUFFERS) and not _forward_backward_only(c)) + \
        sum(c.bytes for c in components if c.name in kept)
    return Phase(name, components, peak, after, basis)


def _without_moments(component: Component, step: StepState) -> Component:
    masters = 0 if step.masters_in_step else step.masters
    why = ("the precision-aware optimizer's master weights and the moments are created in the first step "
           "(FusedAdam.initialize_state)" if step.masters_in_step else
           f"the fp32 main copies only ({step.masters:,} B, made with the optimizer); the {step.moments:,} B of "
           "moments are created in the first step()")
    return Component(STATIC, component.name, masters, f"{why}; all of: {component.basis}")


DEFERRED_WGRAD = "deferred output-layer wgrad inputs"


def _forward_backward_only(component: Component) -> bool:
    """Buffers gone before the step: those of ``defer_embedding_wgrad_compute`` (drained at the pipeline flush,
    schedules.py L886-899) and Megatron-FSDP's unsharded buckets (:data:`.fsdp.UNITS`, freed by
    ``finish_grad_sync``)."""
    return component.name in (DEFERRED_WGRAD, FSDP_UNITS)


def wgrad_deferral_component(provider, *, limit: Optional[int], seq: int, micro_batch: int, vocab_local: int,
                             element: int, num_microbatches: int) -> Optional[Component]:
    """What ``defer_embedding_wgrad_compute`` keeps on the last stage beyond the microbatch in backward.

    Megatron Core's output layer appends its input to ``embedding_activation_buffer`` in forward
    (``tensor_parallel/layers.py`` L1149-1154) and its output gradient to ``grad_output_buffer`` in backward
    instead of computing the weight gradient (L604-607), for the first ``wgrad_deferral_limit`` microbatches (0:
    all of them), until the pipeline flush drains them (``pipeline_parallel/schedules.py`` L886-899). At the last
    microbatch's backward the earlier ones' pairs are held: ``min(limit, M - 1)`` of them (``M - 1`` for limit 0);
    the last one's are its own activations and logits gradient, counted there. ``limit``: the config's
    ``wgrad_deferral_limit`` with the deferral on, None with it off.
    """
    if limit is None or not vocab_local:
        return None
    held = min(limit, num_microbatches - 1) if limit else num_microbatches - 1
    tp = provider.tensor_model_parallel_size
    sp = bool(provider.sequence_parallel) and tp > 1
    local_seq = seq // tp if sp else seq
    per = (local_seq * micro_batch * provider.hidden_size + seq * micro_batch * vocab_local) * element
    return Component(BUFFERS, DEFERRED_WGRAD, held * per,
                     f"formula: defer_embedding_wgrad_compute, wgrad_deferral_limit={limit}: {held} earlier "
                     f"microbatch(es) of {num_microbatches} x ([{local_seq}, {micro_batch}, {provider.hidden_size}] "
                     f"input + [{seq}, {micro_batch}, {vocab_local}] output gradient) x {element} B, held until the "
                     "pipeline flush (Megatron Core tensor_parallel/layers.py L604-607, L1149-1154; "
                     "schedules.py L886-899)")


def cuda_graph_note(provider) -> Optional[str]:
    """When a config's CUDA-graph pools appear and what the estimate counts of them, as one line, else None."""
    impl = getattr(provider, "cuda_graph_impl", None) or "none"
    if impl == "none":
        return None
    warmup = getattr(provider, "cuda_graph_warmup_steps", 0) or 0
    counted = ("the static buffers its graphs hold are the '" + CUDA_GRAPHS + "' phase, its intermediates the "
               "traced activations" if impl in ("local", "transformer_engine") else
               "a full-iteration graph's pool holds the step's own allocations, the traced ones")
    return (f"{CUDA_GRAPHS}: cuda_graph_impl={impl!r} captures once cuda_graph_warmup_steps={warmup} iteration(s) "
            f"are done (Bridge training/train.py L429-441), so its pools appear in iteration {warmup + 1}; "
            f"{counted}; the pool's reserved but free memory is not modelled")


@dataclass(frozen=True)
class PredictedReport:
    """One memory report line Bridge's ``training_log`` prints, as the estimate predicts it.

    ``iteration``: the report is taken after it (``(after N iterations) memory (GB)``); ``phase``: the largest
    phase up to then, whose peak ``mem-max-allocated-gigabytes`` shows (torch's peak is not reset between);
    ``stage``: the pipeline stage whose ranks print it (``ranks``: DP rank 0 of each of its TP x CP ranks);
    bytes and Bridge's rounded GB (10^9 bytes, 5 significant digits) of max allocated and allocated.
    """

    iteration: int
    phase: str
    stage: int
    ranks: tuple[int, ...]
    max_allocated_bytes: int
    allocated_bytes: int
    unmodelled: Optional[str] = None

    @property
    def max_allocated_gigabytes(self) -> float:
        return bridge_gigabytes(self.max_allocated_bytes)

    @property
    def allocated_gigabytes(self) -> float:
        return bridge_gigabytes(self.allocated_bytes)


def bridge_gigabytes(nbytes: int) -> float:
    """Bytes as Bridge's ``report_memory`` prints them (train_utils.py L1286-1292): / 1e9, 5 significant digits."""
    value = nbytes / 1.0e9
    if value == 0:
        return value
    return round(value, -int(math.floor(math.log10(abs(value)))) + 4)


def report_iterations(log_interval: int, train_iters: Optional[int] = None, start: int = 0) -> list[int]:
    """The iterations after which Bridge 0.5.1 and 0.6.2 print memory (train_utils.py ``training_log``
    L1103/L1226-1239): every ``log_interval``-th while ``report_memory_flag`` holds, which clears after the
    first report past iteration ``start + 1`` ("Make sure the memory after the second iteration is reported")."""
    out = []
    iteration = (start // log_interval + 1) * log_interval
    while train_iters is None or iteration <= train_iters:
        out.append(iteration)
        if iteration > start + 1:
            break
        iteration += log_interval
    return out


def predicted_reports(estimate_result, iterations: Optional[list[int]] = None) -> list[PredictedReport]:
    """For each memory report line the installed Bridge prints, the estimate's prediction (see
    :class:`PredictedReport`), for every estimated pipeline stage (first and last; every stage of a hybrid model).

    ``iterations``: the iterations after which reports were taken (a log's lines say them); default: those the config's
    ``logger.log_interval`` and ``train.train_iters`` make Bridge print (:func:`report_iterations`).
    A resumed run (its estimate has the :data:`RESUME` phase) has its moments from the checkpoint before iteration 1,
    and torch's peak counts the load's.
    """
    s = estimate_result.settings
    per_stage = estimate_result.stage_phase_peaks or \
        {estimate_result.stage: {p.name: (p.peak_bytes, p.after_bytes) for p in phases(estimate_result)}}
    graphs = s.reports.cuda_graph_first_iteration
    out = []
    if iterations is None:
        iterations = report_iterations(s.reports.log_interval, s.reports.train_iters)
    for iteration in iterations:
        for stage, peaks in sorted(per_stage.items()):
            reached = [name for name in (RESUME, ITERATION_1, FIRST_STEP, STEADY, CUDA_GRAPHS) if name in peaks
                       and (iteration >= 2 or name != STEADY)
                       and (name != CUDA_GRAPHS or (graphs is not None and iteration >= graphs))]
            phase = max(reached, key=lambda name: peaks[name][0])
            last = FIRST_STEP if FIRST_STEP in peaks else STEADY  # every report follows a step
            last = CUDA_GRAPHS if CUDA_GRAPHS in reached else last  # its static buffers outlive the step
            out.append(PredictedReport(
                iteration, phase, stage, _ranks(s, stage), peaks[phase][0], peaks[last][1],
                unmodelled=f"{CUDA_GRAPHS} pools from iteration {graphs} (not modelled)"
                if graphs is not None and iteration >= graphs and CUDA_GRAPHS not in peaks else None))
    return out


def _ranks(s: Settings, stage: int) -> tuple[int, ...]:
    """DP rank 0 of the stage's TP x CP ranks in Megatron Core's default rank order ``tp-cp-ep-dp-pp``
    (parallel_state.initialize_model_parallel, ``order``): stage p starts at p x TP x CP x DP."""
    tp, cp, dp = s.tp, s.cp, s.dp
    first = stage * tp * cp * dp
    return tuple(range(first, first + tp * cp))
