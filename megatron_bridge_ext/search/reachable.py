"""The plain ``mbx plan``'s answer: the fastest fitting combination of the levers reachable from the layout as given.

The levers, on the same GPUs: TP x 2 and PP x 2 (DP shrinks to keep the GPUs), EP x 2 and the expert TP x 2 on a
mixture-of-experts model, sequence parallelism on (with TP > 1), a smaller micro-batch (the global batch kept), every
set of the selective recompute modules that can save memory here and full recompute, and, where a LoRA-family PEFT
runs under sequence parallelism, ``sequence_parallel_input_strategy="shard_local"`` (less traffic; kept only where
it lowers the answer's peak). They are walked by the rule of ``mbx plan --search`` (:mod:`.walk`, :mod:`.rule`):
fastest predicted first, the first that fits is the answer, and then a lever whose removal leaves the peak where it is
goes (:func:`.rule.drop_idle`).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from megatron_bridge_ext.config import MemoryConfig
from megatron_bridge_ext.estimate import trace_cache
from megatron_bridge_ext.levers.lora_input.config import PEFT_FIELD, shard_local_wanted
from megatron_bridge_ext.levers.parallelism.constraints import MAX_TP, layout_findings
from megatron_bridge_ext.levers.parallelism.cost import moe_shape
from megatron_bridge_ext.levers.step import Option, State
from megatron_bridge_ext.search import candidates as cands, report, rule, walk

if TYPE_CHECKING:
    from megatron_bridge_ext.planner import Planner

LEVER = "fastest combination"
"""The answer's lever name: it combines the levers of the decision order."""
PER_CANDIDATE = ("data_parallel_size", "num_microbatches")
"""Estimate options each candidate sets itself."""


def reachable(given: cands.Candidate, shape: dict, *, global_batch: int, modules: list[str]) -> list[cands.Candidate]:
    """Every legal candidate (:func:`layout_findings`) the levers reach from ``given`` on its GPUs."""
    world = given.tp * given.pp * given.cp * given.dp
    experts = bool(shape.get("experts"))
    tps = sorted({given.tp} | ({2 * given.tp} if 2 * given.tp <= MAX_TP else set()))
    eps = sorted({given.ep, 2 * given.ep}) if experts else [given.ep]
    etps = sorted({given.etp, 2 * given.etp}) if experts else [None]
    rcs = cands.recompute_sets(_modules(given, modules))
    if given.recompute not in rcs:
        rcs.append(given.recompute)
    out = []
    for tp, pp, ep, etp, sp, mb in itertools.product(tps, (given.pp, 2 * given.pp), eps, etps, (given.sp, True),
                                                     cands.divisors(given.micro_batch)):
        grid = tp * pp * given.cp
        if world % grid or (sp and tp == 1):
            continue
        etp = (given.etp if tp == given.tp else tp) if etp is None else etp  # dense: the expert TP follows TP
        dp = world // grid
        if layout_findings(shape, world=world, global_batch=global_batch, tp=tp, pp=pp, vpp=given.vpp, cp=given.cp,
                           ep=ep, etp=etp, dp=dp, sp=sp, micro_batch=mb):
            continue
        # every field these levers do not move (VPP, CP, the optimizer and the memory levers) stays as given
        out += [replace(given, tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, sp=sp, micro_batch=mb, recompute=rc)
                for rc in rcs]
    return list(dict.fromkeys(out))


def _modules(given: cands.Candidate, modules: list[str]) -> list[str]:
    """The modules worth measuring here and those the config already recomputes."""
    mine = list(given.recompute) if given.recompute != cands.FULL else []
    return list(dict.fromkeys(modules + mine))


def answer(planner: Planner, cfg, baseline, *, usable: int, usable_expandable: int,
           expandable_on: bool) -> Optional[Option]:
    """The fastest fitting candidate of :func:`reachable` as an option (not in the decision-order table), with no
    lever that does not lower its peak; None when none fits."""
    from megatron_bridge_ext.levers.recompute.advice import candidates_for

    s = baseline.settings
    given = cands.given(cfg, s.dp)
    shape = cands.shape_of(cfg.model, s)
    legal = reachable(given, shape, global_batch=cfg.train.global_batch_size,
                      modules=candidates_for(s, moe_shape(cfg.model)))
    shard_local = shard_local_wanted(cfg)
    options = {k: v for k, v in planner.estimate_options.items() if k not in PER_CANDIDATE}
    with trace_cache.reuse():
        found = walk.search(cfg, baseline, world=given.tp * given.pp * given.cp * given.dp, usable=usable,
                            usable_expandable=usable_expandable, expandable_on=expandable_on, gpu=planner.gpu,
                            estimate_options=options, budget_s=0, legal=legal, keep_estimates=True,
                            apply=lambda c_cfg, c: _apply(c_cfg, given, c, shard_local))
        best = found.answer
        if best is None:
            return None
        allowed = set(legal)
        best, saves = rule.drop_idle(best, given, lambda c: found.estimator(c) if c in allowed else None)
        c_cfg, est = found.estimator.estimates[best.candidate]
        if shard_local and best.candidate.sp:
            c_cfg, est, shard_local = _shard_local_kept(planner, cfg, given, best, (c_cfg, est), saves, options)
    return _option(planner, cfg, given, best, (c_cfg, est), shard_local and best.candidate.sp, saves, expandable_on,
                   (usable, usable_expandable))


def _shard_local_kept(planner: Planner, cfg, given: cands.Candidate, best, with_it: tuple, saves: dict,
                      options: dict) -> tuple:
    """The answer without ``shard_local`` when that leaves its peak where it is (the lever saves nothing here), else
    as it is with the saving recorded: the config, its estimate, and whether ``shard_local`` stays."""
    c = best.candidate
    without = _apply(cfg, given, c, False)
    est = planner.estimate(without, **options, data_parallel_size=c.dp,
                           num_microbatches=cfg.train.global_batch_size // (c.micro_batch * c.dp))
    if est.peak_bytes <= best.peak_bytes:
        return without, est, False
    saves[f"{PEFT_FIELD} shard_local"] = est.peak_bytes - best.peak_bytes
    return *with_it, True


FIELDS = {
    "tp": ("model.tensor_model_parallel_size",),
    "pp": ("model.pipeline_model_parallel_size", "model.num_layers_in_first_pipeline_stage",
           "model.num_layers_in_last_pipeline_stage", "model.microbatch_group_size_per_vp_stage"),
    "vpp": ("model.virtual_pipeline_model_parallel_size", "model.microbatch_group_size_per_vp_stage"),
    "cp": ("model.context_parallel_size",), "sp": ("model.sequence_parallel",),
    "micro_batch": ("train.micro_batch_size",),
    "ep": ("model.expert_model_parallel_size",), "etp": ("model.expert_tensor_parallel_size",),
    "recompute": ("model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers",
                  "model.recompute_modules"),
    "distributed_optimizer": ("optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer")}
"""The config fields each candidate field sets (:func:`.candidates.apply`): only a lever that moves touches its own."""


def _selective(given: cands.Candidate, c: cands.Candidate) -> bool:
    """Whether ``c``'s recompute is a change of selective modules (made by ``MemoryConfig``, as the walk makes it)."""
    return c.recompute not in ((), cands.FULL) and given.recompute != cands.FULL and c.recompute != given.recompute


def _moved(cfg, given: cands.Candidate, c: cands.Candidate) -> tuple:
    """A copy of ``cfg`` with the fields of the levers ``c`` moves set as :func:`.candidates.apply` sets them, the
    rest untouched; and those fields' paths."""
    full = cands.apply(cfg, c)
    out = copy.deepcopy(cfg)
    paths = [p for f, ps in FIELDS.items() if getattr(given, f) != getattr(c, f) for p in ps]
    for path in paths:
        *parents, name = path.split(".")
        setattr(_get(out, parents), name, _get(full, path.split(".")))
    out.data_parallel_size = c.dp
    return out, list(dict.fromkeys(paths))


def _apply(cfg, given: cands.Candidate, c: cands.Candidate, shard_local: bool):
    """``cfg`` set to candidate ``c``: its layout fields, then selective recompute and the LoRA-A input by
    ``MemoryConfig`` (what the answer's flags do)."""
    selective = _selective(given, c)
    out, _ = _moved(cfg, given, replace(c, recompute=given.recompute) if selective else c)
    if selective:
        MemoryConfig(recompute_modules=list(c.recompute), expandable_segments=False).apply(out)
    if shard_local and c.sp:
        MemoryConfig(sequence_parallel_input_strategy="shard_local", expandable_segments=False).apply(out)
    return out


def _option(planner: Planner, cfg, given: cands.Candidate, best, estimated: tuple, shard_local: bool, saves: dict,
            expandable_on: bool, usables: tuple[int, int]) -> Option:
    """``best`` as an option: MemoryConfig flags for the allocator (where the peak needs it), the LoRA-A input and
    selective recompute; overrides for the rest (the layout, SP, micro-batch, full or no recompute)."""
    c = best.candidate
    selective = _selective(given, c)
    layout_cfg, paths = _moved(cfg, given, replace(c, recompute=given.recompute) if selective else c)
    flags = {"expandable_segments": bool(best.expandable or expandable_on)}
    if shard_local:
        flags[PEFT_FIELD] = "shard_local"
    if selective:
        flags["recompute_modules"] = list(c.recompute)
    overrides = [f"{p}={_text(_get(layout_cfg, p.split('.')))}" for p in paths
                 if _get(cfg, p.split(".")) != _get(layout_cfg, p.split("."))]
    c_cfg, est = estimated
    option = Option(0, LEVER, report.changes(given, c) + (f", {PEFT_FIELD} shard_local" if shard_local else ""),
                    True)
    planner.fill(option, State(c_cfg, est, flags, overrides), flags_on=layout_cfg)
    option.usable_bytes = usables[1] if flags["expandable_segments"] else usables[0]
    option.saves = saves
    return option


def _get(cfg, names: list[str]):
    for name in names:
        cfg = getattr(cfg, name, None)
    return cfg


def _text(value) -> str:
    """A value as Bridge's override parser reads it: null, true/false, [a,b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)
