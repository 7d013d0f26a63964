"""The search: candidates ranked by predicted step time, estimated fastest first, with what needs no estimate pruned.

Pruning rests on the memory order of :meth:`.candidates.Candidate.below` (the same layout, a smaller micro-batch, more
recompute, SP and the distributed optimizer on hold no more memory on any term):

* a candidate above one that does not fit does not fit either (not estimated);
* a candidate above a faster estimated one is dominated: no less memory for no less time (not estimated);
* before a candidate, its least-memory relatives are estimated when first reached, unless one holds no more than a
  candidate that fits (:func:`.candidates.least_memory_relatives`: its layout and optimizer options with the widest
  recompute and offload covering its own, at micro-batch 1 and at its own; with ``legal`` given, its micro-batch-1
  floor): when one does not fit, neither does anything above it;
* the optimizer is offloaded to the CPU only where the same candidate without it does not fit: one whose twin fits,
  or was dominated, is not estimated (the twin is predicted faster, so it was reached first).

The first estimated candidate that fits is the fastest that fits (every later one is predicted slower); the walk goes
on, within ``budget_s``, to fill the front (the plain plan, :mod:`.reachable`, stops there: ``budget_s=0``). The answer
is :func:`.rule.fastest` of what was estimated. Estimates share traces (:mod:`..estimate.trace_cache`).
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from megatron_bridge_ext.estimate import trace_cache
from megatron_bridge_ext.findings import Refused
from megatron_bridge_ext.levers import optimizer_offload, steptime
from megatron_bridge_ext.levers.activation_offload import cost as offload_cost
from megatron_bridge_ext.levers.parallelism.cost import moe_shape
from megatron_bridge_ext.search import candidates as cands, rule
from megatron_bridge_ext.search.front import pareto

BUDGET_S = 20.0
"""Seconds of estimates the walk spends filling the front once it has an answer."""


@dataclass
class Evaluated:
    candidate: cands.Candidate
    peak_bytes: int
    peak_phase: str
    step: steptime.StepTime
    fits: bool
    expandable: bool
    """It fits only with expandable segments (the answer then turns them on)."""
    flops: float
    """Model FLOPs of the rank's step (the last stage), recompute included."""

    @property
    def step_time_s(self) -> float:
        return self.step.total


@dataclass
class Search:
    given: cands.Candidate
    world: int
    global_batch: int
    seq: int
    usable: int
    usable_expandable: int
    evaluated: list[Evaluated] = field(default_factory=list)
    refused: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    layers: int = 0
    shard_local: bool = False
    """The LoRA-A input ``shard_local`` on every candidate with SP (a LoRA run whose config leaves it off: it holds
    less and sends less, :func:`..levers.lora_input.config.shard_local_wanted`); the answer's MemoryConfig sets it."""
    estimator: Optional["Estimator"] = field(default=None, repr=False)
    """What estimated the candidates (more can be estimated through it, inside the same trace reuse)."""

    @property
    def answer(self) -> Optional[Evaluated]:
        return rule.fastest(self.evaluated, self.given)

    @property
    def front(self) -> list[Evaluated]:
        """The Pareto front of the estimated candidates: exact where they fit; beyond the usable memory the walk
        prunes what cannot fit without estimating it, so there it is the front of what was estimated."""
        return pareto(self.evaluated)

    def given_evaluated(self) -> Optional[Evaluated]:
        return next((e for e in self.evaluated if e.candidate == self.given), None)


def search(cfg, base_est, *, world: int, usable: int, usable_expandable: int, expandable_on: bool, gpu,
           estimate_options: dict, budget_s: float = BUDGET_S, legal: Optional[list] = None,
           apply=cands.apply, keep_estimates: bool = False, shard_local: bool = False) -> Search:
    """Search every legal candidate of ``cfg``'s workload on ``world`` GPUs (``base_est``: the estimate of ``cfg`` as
    given, whose settings the step times are moved from), or the candidates ``legal`` where given. ``apply`` sets a
    candidate on a copy of ``cfg``. ``budget_s=0`` stops at the first candidate that fits: the answer.
    ``keep_estimates``: keep each estimate and config on ``search.estimator`` (the plain plan's answer needs them).
    ``shard_local``: every candidate with SP runs the LoRA-A input ``shard_local`` (:attr:`Search.shard_local`)."""
    from megatron_bridge_ext.levers.recompute.advice import candidates_for

    t0 = time.perf_counter()
    gb = cfg.train.global_batch_size
    base = base_est.settings
    shape = cands.shape_of(cfg.model, base)
    moe = moe_shape(cfg.model)
    given = cands.given(cfg, base.dp)
    def predict(c: cands.Candidate) -> float:
        return _predicted_time(base, c, shape, gb, gpu, moe)

    if legal is None:
        seen, branches = cands.enumerate_branches(
            shape, world=world, global_batch=gb, modules=candidates_for(base, moe),
            offloads=tuple(cands.offload_sets(cfg.model, fp8=shape["fp8"])),
            optimizer_offload_allowed=optimizer_offload.searchable(cfg.optimizer, cfg.ddp))
        out = Search(given, world, gb, shape["seq"], usable, usable_expandable,
                     counts={"enumerated": seen, "legal": sum(b.size() for b in branches)}, layers=shape["layers"])
        t1 = time.perf_counter()
        predicted = {given: predict(given)} if any(b.contains(given) for b in branches) else {}
        order = lazy_order(branches, predict, lambda b: branch_bound(base, b, shape, gb, gpu, moe), given, predicted)
        recomputes, offloads = branches[0].recomputes if branches else (), branches[0].offloads if branches else ()

        def relatives(c: cands.Candidate) -> list:
            return cands.least_memory_relatives(c, recomputes, offloads)
    else:
        out = Search(given, world, gb, shape["seq"], usable, usable_expandable,
                     counts={"enumerated": len(legal), "legal": len(legal)}, layers=shape["layers"])
        t1 = time.perf_counter()
        predicted = {c: predict(c) for c in legal}
        order = iter(rule.walk_order(legal, predicted, given))
        relatives = _floors
    out.shard_local = shard_local
    if shard_local:
        apply = _with_shard_local(apply)
    t2 = time.perf_counter()
    with trace_cache.reuse():
        run = Estimator(cfg, out, gpu=gpu, moe=moe, expandable_on=expandable_on, estimate_options=estimate_options,
                        apply=apply, keep=keep_estimates)
        out.estimator = run
        pruned, dominated, unneeded = _walk(run, out, order, predicted, budget_s, relatives)
        out.counts.update(estimated=len(run.done), not_estimable=len(out.refused), pruned_not_fitting=pruned,
                          pruned_dominated=dominated, pruned_optimizer_offload=unneeded, traces=trace_cache.misses,
                          trace_reuses=trace_cache.hits, step_times=len(predicted))
    t3 = time.perf_counter()
    out.seconds = {"enumerate": t1 - t0, "order": t2 - t1, "walk": t3 - t2, **out.seconds}
    return out


def _with_shard_local(apply):
    """``apply``, then the LoRA-A input ``shard_local`` where the candidate runs SP, as the answer's MemoryConfig line
    sets it."""
    from megatron_bridge_ext.config import MemoryConfig

    def applied(cfg, c: cands.Candidate):
        out = apply(cfg, c)
        if c.sp:
            MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False).apply(out)
        return out
    return applied


def branch_bound(base, branch: cands.Branch, shape: dict, global_batch: int, gpu, moe: Optional[dict]) -> float:
    """A lower bound of the predicted step time of every candidate of ``branch``: the time of its first recompute
    set (none, at the top) without the exposed data-parallel and offload copies (each at least 0), with the fastest
    optimizer step among its optimizer options. Recompute adds work to the compute and takes from the exposed TP and
    CP communication no more than it adds to the linears and the core it repeats; the optimizer options move only
    the data-parallel traffic (:func:`..levers.steptime.dp_bytes`) and the optimizer's step."""
    c = branch.fastest_settings()
    st = steptime.step_time(cands.settings_for(base, c, shape, global_batch), gpu, moe=_moe_of(moe, c))
    fastest_step = min(steptime.optimizer_seconds(
        cands.settings_for(base, replace(c, distributed_optimizer=do, fsdp=strategy, bf16_moments=moments,
                                         optimizer_offload=share, optimizer_overlap=share is not None),
                           shape, global_batch), gpu, _moe_of(moe, c))
        for do, strategy, moments, share in branch.memory)
    return st.total - st.dp_exposed - st.offload_exposed - st.optimizer + fastest_step


def lazy_order(branches: list, predict, bound, given: cands.Candidate, predicted: dict) -> Iterator[cands.Candidate]:
    """The candidates of ``branches`` in :func:`.rule.walk_order`'s order (fastest predicted first, fewer levers at
    equal time), each predicted (into ``predicted``) only once every branch whose bound is below its time has been
    opened: a heap of branches keyed by their ``bound`` and candidates by their time, a branch opened into its
    children when it comes first."""
    heap: list = []
    counter = itertools.count()

    def push(item) -> None:
        if isinstance(item, cands.Branch):
            heapq.heappush(heap, (bound(item), -1, next(counter), item))
        else:
            predicted[item] = predicted.get(item) or predict(item)
            heapq.heappush(heap, (predicted[item], rule.lever_count(given, item), next(counter), item))

    for branch in branches:
        push(branch)
    while heap:
        *_, item = heapq.heappop(heap)
        if isinstance(item, cands.Branch):
            for child in item.children():
                push(child)
        else:
            yield item


def _moe_of(moe: Optional[dict], c: cands.Candidate) -> Optional[dict]:
    return None if moe is None else {**moe, "ep": c.ep, "etp": c.etp}


def _predicted_time(base, c: cands.Candidate, shape: dict, global_batch: int, gpu, moe: Optional[dict]) -> float:
    """The step time of ``c`` before it is estimated: the given config's settings moved to it, its offloaded
    activations (if any) priced from the shapes (:func:`..levers.activation_offload.cost.predicted_host_bytes`)."""
    s = cands.settings_for(base, c, shape, global_batch)
    host = offload_cost.predicted_host_bytes(s, c.offload) if c.offload else 0
    return steptime.step_time(s, gpu, moe=_moe_of(moe, c),
                              offload_bytes=offload_cost.step_bytes(host, s.num_microbatches)).total


class Estimator:
    """Estimates candidates of one search, each once: an :class:`Evaluated` recorded on the search, or None with the
    reason in ``search.refused``."""

    def __init__(self, cfg, search: Search, *, gpu, moe: Optional[dict], expandable_on: bool, estimate_options: dict,
                 apply=cands.apply, keep: bool = False):
        self.cfg, self.search, self.gpu, self.moe = cfg, search, gpu, moe
        self.expandable_on, self.estimate_options, self.apply = expandable_on, estimate_options, apply
        self.done: dict = {}
        self.unfit: list = []
        self.keep = keep
        self.estimates: dict = {}
        """Each estimated candidate's config and :class:`~megatron_bridge_ext.estimate.report.MemoryEstimate`, kept
        only with ``keep``."""

    def __call__(self, c: cands.Candidate) -> Optional[Evaluated]:
        from megatron_bridge_ext.estimate import estimate

        if c in self.done:
            return self.done[c]
        out, gb = self.search, self.search.global_batch
        cfg = self.apply(self.cfg, c)
        try:
            est = estimate(cfg, data_parallel_size=c.dp, num_microbatches=gb // (c.micro_batch * c.dp),
                           **self.estimate_options)
        except Refused as refused:
            out.refused[c] = refused.one_line()
            self.done[c] = None
            return None
        except Exception as error:  # upstream code under a layout no test ran: one candidate lost, not the search
            out.refused[c] = f"the estimate failed: {type(error).__name__}: {error}"
            self.done[c] = None
            return None
        phase = max(est.phases, key=lambda p: p.peak_bytes)
        s = est.settings
        moe = _moe_of(self.moe, c)
        st = steptime.step_time(s, self.gpu, moe=moe,
                                offload_bytes=offload_cost.step_bytes(est.offload_host_bytes, s.num_microbatches))
        e = Evaluated(c, est.peak_bytes, phase.name, st, est.peak_bytes <= out.usable_expandable,
                      not self.expandable_on and out.usable < est.peak_bytes <= out.usable_expandable,
                      s.num_microbatches * steptime.microbatch_flops(s, moe))
        self.done[c] = e
        if self.keep:
            self.estimates[c] = (cfg, est)
        out.evaluated.append(e)
        if not e.fits:
            self.unfit.append(c)
        return e


def _walk(run: Estimator, out: Search, order, predicted: dict, budget_s: float,
          relatives=None) -> tuple[int, int, int]:
    """Estimate ``order`` (fastest predicted first) but what the memory order prunes; stop ``budget_s`` after the
    first candidate that fits. Returns how many candidates were pruned as not fitting, as dominated, and as offloading
    the optimizer without need (:func:`_offload_unneeded`)."""
    relatives = relatives or _floors
    probed: set = set()
    skipped: set = set()
    pruned = dominated = unneeded = 0
    started = time.perf_counter()
    if out.given in predicted:
        run(out.given)
    answer_at = None
    for c in order:
        if answer_at is not None and time.perf_counter() - answer_at > budget_s:
            break
        if any(u.below(c) for u in run.unfit):
            pruned += 1
            continue
        if any(e.candidate.below(c) and e.step_time_s <= predicted[c] for e in out.evaluated):
            dominated += 1
            skipped.add(c)
            continue
        if _offload_unneeded(c, run.done, skipped, out.given):
            unneeded += 1
            continue
        if _a_relative_does_not_fit(c, relatives(c), run, out.evaluated, probed):
            pruned += 1
            continue
        e = run(c)
        if e is not None and e.fits and answer_at is None:
            answer_at = time.perf_counter()
            out.seconds["to_first_fit"] = answer_at - started
    return pruned, dominated, unneeded


def _offload_unneeded(c: cands.Candidate, done: dict, skipped: set, given: cands.Candidate) -> bool:
    """``c`` offloads the optimizer where its twin without the offload fits or was dominated (not the given
    config, which is estimated as it is)."""
    if c.optimizer_offload is None or c == given:
        return False
    twin = replace(c, optimizer_offload=None, optimizer_overlap=False)
    return twin in skipped or (done.get(twin) is not None and done[twin].fits)


def _a_relative_does_not_fit(c: cands.Candidate, relatives: list, run: Estimator, evaluated: list,
                             probed: set) -> bool:
    """Whether one of ``c``'s ``relatives`` (candidates holding no more memory than ``c``, least first) does not fit;
    each estimated the first time it is asked about unless it is known to fit (then it prunes nothing)."""
    for r in relatives:
        if r not in probed:
            probed.add(r)
            if not _known_to_fit(r, evaluated):
                run(r)
        if r in run.unfit and r.below(c):
            return True
    return False


def _known_to_fit(c: cands.Candidate, evaluated: list) -> bool:
    """``c`` holds no more memory than a candidate that fits (:meth:`.candidates.Candidate.below`): it fits too. A
    floor known to fit prunes nothing, so it is not estimated."""
    return any(e.fits and c.below(e.candidate) for e in evaluated)


def _floors(c: cands.Candidate) -> list:
    """``c``'s micro-batch-1 floor, the relative the walk checks where the candidates are given."""
    floor = _floor(c)
    return [] if floor is None else [floor]


def _floor(c: cands.Candidate) -> Optional[cands.Candidate]:
    """The least memory of ``c``'s layout and recompute: micro-batch 1 (None when ``c`` is that already)."""
    return None if c.micro_batch == 1 else replace(c, micro_batch=1)
