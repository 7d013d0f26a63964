"""The candidates of a search: one parallel layout, micro-batch, recompute and optimizer choice each, legal by the
rules of :func:`megatron_bridge_ext.levers.parallelism.constraints.layout_findings`, with the overrides that make it."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, replace
from typing import Optional, Union

from megatron_bridge_ext.levers import fsdp, optimizer_offload
from megatron_bridge_ext.levers.activation_offload.cost import ATTENTION as ATTENTION_OFFLOAD
from megatron_bridge_ext.levers.activation_offload.cost import EXPERTS as EXPERT_OFFLOAD
from megatron_bridge_ext.levers.parallelism.constraints import MAX_TP, expert_sizes, layout_findings, uneven_split
from megatron_bridge_ext.levers.recompute.advice import INSIDE_MOE
from megatron_bridge_ext.levers.recompute.config import offloaded_inside_moe

FULL = "full"
"""Full recompute: Core's ``uniform`` method, every layer (``recompute_num_layers=1``)."""
MAX_VPP = 4
"""Largest interleaving tried: beyond it the bubble is a few percent of the step and the in-flight activations grow."""
MAX_CP = 8


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    ep: int
    etp: int
    dp: int
    sp: bool
    micro_batch: int
    recompute: Union[tuple, str]
    """``()`` none, a tuple of selective modules, or :data:`FULL`."""
    distributed_optimizer: bool
    fsdp: Optional[str] = None
    """Megatron-FSDP's sharding strategy (:mod:`..levers.fsdp`); None: Core's DDP."""
    bf16_moments: bool = False
    """The precision-aware optimizer with bf16 ``exp_avg`` and ``exp_avg_sq`` (:func:`..levers.fsdp.moment_overrides`)."""
    offload: tuple = ()
    """The ``offload_modules`` of fine-grained activation offloading, ``()`` with it off."""
    optimizer_offload: Optional[float] = None
    """The share of the optimizer's shard stepped on the CPU (:mod:`..levers.optimizer_offload`); None: all on the GPU."""
    optimizer_overlap: bool = False
    """``overlap_cpu_optimizer_d2h_h2d`` with the optimizer offloaded (the search's candidates turn it on)."""

    @property
    def layout(self) -> tuple:
        """What the memory order below compares within: the grid and the pipeline schedule."""
        return self.tp, self.pp, self.vpp, self.cp, self.ep, self.etp, self.dp

    def below(self, other: "Candidate") -> bool:
        """Whether this candidate holds at most ``other``'s memory on every term: the same layout, a micro-batch no
        larger, recompute covering ``other``'s (a superset of selective modules), SP and the distributed optimizer
        on wherever ``other`` has them, the same Megatron-FSDP strategy, bf16 moments wherever ``other`` has them (the
        precision-aware optimizer's 2 + 2 bytes per element for Adam's 4 + 4, and no fp32 copies in its step:
        :func:`..estimate.phases.unscaled_states`), at least ``other``'s share of the optimizer offloaded."""
        return (self.layout == other.layout and self.micro_batch <= other.micro_batch
                and covers(self.recompute, other.recompute) and self.sp >= other.sp
                and self.distributed_optimizer >= other.distributed_optimizer
                and self.fsdp == other.fsdp and self.bf16_moments >= other.bf16_moments
                and set(self.offload) >= set(other.offload)
                and (self.optimizer_offload or 0.0) >= (other.optimizer_offload or 0.0))

    def overrides(self, layers: int, given: Optional["Candidate"] = None) -> list[str]:
        """Bridge override strings that set this candidate on the given config of ``layers`` layers (``given``: that
        config as a candidate, whose Megatron-FSDP checkpoint format a candidate without it must undo)."""
        out = [f"model.tensor_model_parallel_size={self.tp}", f"model.pipeline_model_parallel_size={self.pp}",
               f"model.virtual_pipeline_model_parallel_size={'null' if self.vpp is None else self.vpp}",
               "model.microbatch_group_size_per_vp_stage=null",
               f"model.context_parallel_size={self.cp}", f"model.sequence_parallel={str(self.sp).lower()}",
               f"train.micro_batch_size={self.micro_batch}",
               f"optimizer.use_distributed_optimizer={str(self.distributed_optimizer).lower()}",
               f"ddp.use_distributed_optimizer={str(self.distributed_optimizer).lower()}"]
        first_last = uneven_split(layers, self.pp)
        split = ["model.num_layers_in_first_pipeline_stage={}".format(first_last[0] if first_last else "null"),
                 "model.num_layers_in_last_pipeline_stage={}".format(first_last[1] if first_last else "null")]
        offload = [f"model.fine_grained_activation_offloading={str(bool(self.offload)).lower()}"]
        offload += [f"model.offload_modules=[{','.join(self.offload)}]"] if self.offload else []
        return (out + split + self._experts_and_recompute() + offload
                + fsdp.strategy_overrides(self.fsdp, from_fsdp=given is not None and given.fsdp is not None)
                + fsdp.moment_overrides(self.bf16_moments)
                + optimizer_offload.overrides(self.optimizer_offload, self.optimizer_overlap))

    def _experts_and_recompute(self) -> list[str]:
        out = []
        if self.ep > 1 or self.etp != self.tp:
            out += [f"model.expert_model_parallel_size={self.ep}", f"model.expert_tensor_parallel_size={self.etp}"]
        if self.recompute == FULL:
            out += ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1",
                    "model.recompute_modules=null"]
        elif self.recompute:
            out += ["model.recompute_granularity=selective", f"model.recompute_modules=[{','.join(self.recompute)}]",
                    "model.recompute_method=null", "model.recompute_num_layers=null"]
        else:
            out += ["model.recompute_granularity=null", "model.recompute_method=null",
                    "model.recompute_num_layers=null", "model.recompute_modules=null"]
        return out

    def describe(self) -> str:
        rc = "full recompute" if self.recompute == FULL else (f"recompute {'+'.join(self.recompute)}"
                                                              if self.recompute else "no recompute")
        experts = f" EP{self.ep} ETP{self.etp}" if self.ep > 1 else ""
        vpp = f" VPP{self.vpp}" if self.vpp else ""
        return (f"TP{self.tp}{' SP' if self.sp else ''} PP{self.pp}{vpp} CP{self.cp}{experts} DP{self.dp} "
                f"mb{self.micro_batch} {rc}{'' if self.distributed_optimizer else ' no-distopt'}"
                f"{f' FSDP {self.fsdp}' if self.fsdp else ''}{' bf16-moments' if self.bf16_moments else ''}"
                f"{' offload ' + '+'.join(self.offload) if self.offload else ''}"
                f"{f' optimizer-offload {self.optimizer_offload:g}' if self.optimizer_offload is not None else ''}")


def covers(a, b) -> bool:
    """Recompute ``a`` repeats at least what ``b`` does (full covers only full: its checkpoints differ)."""
    if a == FULL or b == FULL:
        return a == b
    return set(a) >= set(b)


def apply(cfg, c: Candidate):
    """A copy of ``cfg`` set to candidate ``c`` (its data-parallel size on ``cfg.data_parallel_size``)."""
    out = copy.deepcopy(cfg)
    m = out.model
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = c.tp, c.pp
    m.virtual_pipeline_model_parallel_size, m.context_parallel_size, m.sequence_parallel = c.vpp, c.cp, c.sp
    m.microbatch_group_size_per_vp_stage = None  # Core's default, PP (model_parallel_config.py L567-568)
    m.num_layers_in_first_pipeline_stage, m.num_layers_in_last_pipeline_stage = \
        uneven_split(m.num_layers, c.pp) or (None, None)
    if getattr(m, "num_moe_experts", None):
        m.expert_model_parallel_size, m.expert_tensor_parallel_size = c.ep, c.etp
    out.train.micro_batch_size = c.micro_batch
    out.optimizer.use_distributed_optimizer = out.ddp.use_distributed_optimizer = c.distributed_optimizer
    if c.recompute == FULL:
        m.recompute_granularity, m.recompute_method, m.recompute_num_layers, m.recompute_modules = \
            "full", "uniform", 1, None
    else:
        m.recompute_granularity = "selective" if c.recompute else None
        m.recompute_method = m.recompute_num_layers = None
        m.recompute_modules = list(c.recompute) if c.recompute else None
    fsdp.apply(out, c.fsdp, c.bf16_moments)
    m.fine_grained_activation_offloading = bool(c.offload)
    m.offload_modules = list(c.offload) if c.offload else None
    optimizer_offload.apply(out.optimizer, c.optimizer_offload, c.optimizer_overlap)
    out.data_parallel_size = c.dp
    return out


def given(cfg, dp: int) -> Candidate:
    """The candidate the config as given is."""
    m = cfg.model
    ep, etp = expert_sizes(m)
    rc = FULL if m.recompute_granularity == "full" else (
        tuple(m.recompute_modules or ("core_attn",)) if m.recompute_granularity == "selective" else ())
    return Candidate(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                     m.virtual_pipeline_model_parallel_size, m.context_parallel_size or 1, ep, etp, dp,
                     bool(m.sequence_parallel) and m.tensor_model_parallel_size > 1, cfg.train.micro_batch_size, rc,
                     bool(cfg.optimizer.use_distributed_optimizer), *fsdp.given(cfg),
                     tuple(m.offload_modules or ()) if getattr(m, "fine_grained_activation_offloading", False) else (),
                     *optimizer_offload.given(cfg.optimizer))


def shape_of(model, settings=None) -> dict:
    """The workload's shape the candidates are enumerated from. ``settings``: the given config's estimate settings,
    whose FP8 is the one Bridge's ``mixed_precision`` sets on the model when it validates the config (a recipe's
    model may not carry it yet)."""
    return {"heads": model.num_attention_heads, "query_groups": model.num_query_groups or model.num_attention_heads,
            "layers": model.num_layers, "seq": model.seq_length, "experts": getattr(model, "num_moe_experts", None),
            "bias": bool(getattr(model, "add_bias_linear", False)), "fp8": bool(getattr(model, "fp8", None) or getattr(settings, "fp8", None))}


def recompute_sets(modules: list[str]) -> list:
    """No recompute, every set of the selective ``modules`` worth measuring (none inside ``moe`` beside it), full."""
    sets = [()]
    for n in range(1, len(modules) + 1):
        sets += [s for s in itertools.combinations(modules, n) if not ("moe" in s and set(s) & set(INSIDE_MOE))]
    return sets + [FULL]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def offload_sets(model, *, fp8: bool = False) -> list[tuple]:
    """No offload, and the attention's inputs offloaded where Bridge allows it (Transformer Engine's layers, no
    layer-level CPU offloading: :mod:`megatron_bridge_ext.levers.activation_offload.constraints`); on an MoE model
    whose experts open their groups (:func:`..estimate.features.expert_offload.groups_open`), not in FP8 (not
    modelled) and without the paged stash (Core refuses them together), the experts' groups too, alone and with the
    attention's."""
    from megatron_bridge_ext.estimate.features.expert_offload import groups_open

    if getattr(model, "transformer_impl", None) != "transformer_engine" or getattr(model, "cpu_offloading", False):
        return [()]
    if fp8 or getattr(model, "moe_paged_stash", False) or not groups_open(model):
        return [(), ATTENTION_OFFLOAD]
    return [(), ATTENTION_OFFLOAD, EXPERT_OFFLOAD, ATTENTION_OFFLOAD + EXPERT_OFFLOAD]


def compatible(recompute, offload: tuple) -> bool:
    """Core takes the recompute set and the offloaded modules together (not ``moe`` recompute beside the experts'
    groups: :func:`..levers.recompute.config.offloaded_inside_moe`)."""
    return recompute == FULL or not offloaded_inside_moe(recompute, offload)


@dataclass(frozen=True)
class Branch:
    """Candidates of one layout and micro-batch (one recompute set too, a level down), each with one of the
    recompute sets ``recomputes``, one of the optimizer options ``memory`` (distributed optimizer, Megatron-FSDP
    strategy, bf16 moments, optimizer offload share: :func:`_optimizer_options`) and one of the activation ``offloads``.
    The search predicts a lower bound of their step times before any of theirs (:mod:`.walk`), so that a large space
    is neither built nor timed where the walk never goes."""

    layout: tuple
    """``(tp, pp, vpp, cp, ep, etp, dp, sp, micro_batch)``."""
    recomputes: tuple
    memory: tuple
    offloads: tuple

    def members(self) -> list[Candidate]:
        return [Candidate(*self.layout, rc, do, strategy, moments, offload=off, optimizer_offload=share,
                          optimizer_overlap=share is not None)
                for rc, off in self._pairs() for do, strategy, moments, share in self.memory]

    def _pairs(self) -> list[tuple]:
        """The (recompute, offload) pairs Core takes together (:func:`compatible`)."""
        return [(rc, off) for rc in self.recomputes for off in self.offloads if compatible(rc, off)]

    def children(self) -> list:
        """One branch per recompute set, or the candidates once there is one."""
        if len(self.recomputes) > 1:
            return [replace(self, recomputes=(rc,)) for rc in self.recomputes]
        return self.members()

    def size(self) -> int:
        return len(self._pairs()) * len(self.memory)

    def contains(self, c: Candidate) -> bool:
        return (c.layout + (c.sp, c.micro_batch) == self.layout and c.recompute in self.recomputes
                and (c.distributed_optimizer, c.fsdp, c.bf16_moments, c.optimizer_offload) in self.memory
                and c.offload in self.offloads and compatible(c.recompute, c.offload)
                and c.optimizer_overlap == (c.optimizer_offload is not None))

    def fastest_settings(self) -> Candidate:
        """The branch's first recompute set (none at the top: :func:`recompute_sets`) on its first optimizer option
        and no activation offload: what its bound is computed on (:func:`..walk.branch_bound`)."""
        do, strategy, moments, share = self.memory[0]
        return Candidate(*self.layout, self.recomputes[0], do, strategy, moments, offload=(),
                         optimizer_offload=share, optimizer_overlap=share is not None)


def least_memory_relatives(c: Candidate, recomputes: tuple, offloads: tuple) -> list[Candidate]:
    """Candidates of ``c``'s layout and optimizer options that hold no more memory than ``c`` on every term and the
    least among those: the widest recompute sets of ``recomputes`` covering ``c``'s (full recompute only for full)
    with the widest activation offload of ``offloads`` covering ``c``'s that Core takes with each
    (:func:`compatible`), at micro-batch 1 and at ``c``'s micro-batch.
    One that does not fit prunes ``c`` (:meth:`Candidate.below`) and every candidate above it."""
    if c.recompute == FULL:
        widest = [FULL]
    else:
        covering = [rc for rc in recomputes if rc != FULL and covers(rc, c.recompute)]
        widest = [rc for rc in covering if not any(set(other) > set(rc) for other in covering)]
    out = []
    for rc in widest:
        offloading = [o for o in offloads if set(o) >= set(c.offload) and compatible(rc, o)]
        if offloading:
            out += [replace(c, micro_batch=mb, recompute=rc, offload=max(offloading, key=len))
                    for mb in (1, c.micro_batch)]
    return [r for r in dict.fromkeys(out) if r != c]


def enumerate_branches(shape: dict, *, world: int, global_batch: int, modules: list[str], offloads: tuple = ((),),
                       optimizer_offload_allowed: bool = False) -> tuple[int, list[Branch]]:
    """How many combinations were looked at, and the legal ones (:func:`layout_findings` finds nothing) as one
    :class:`Branch` per layout and micro-batch; ``optimizer_offload_allowed``: :func:`..levers.optimizer_offload.
    searchable` of the config."""
    seen, out = 0, []
    rcs = tuple(recompute_sets(modules))
    experts = shape.get("experts")
    for tp, pp, cp in itertools.product(divisors(world), repeat=3):
        if world % (tp * pp * cp) or tp > MAX_TP or cp > MAX_CP:
            continue
        dp = world // (tp * pp * cp)
        vpps = [None] + ([v for v in range(2, MAX_VPP + 1)] if pp > 1 else [])
        eps = [e for e in divisors(experts) if e <= tp * cp * dp] if experts else [1]
        memory = tuple((do, *option) for do in (True, False)
                       for option in _optimizer_options(shape, do, dp * cp, optimizer_offload_allowed))
        size = sum(compatible(rc, off) for rc in rcs for off in offloads) * len(memory)
        for vpp, ep, etp, sp in itertools.product(vpps, eps, sorted({1, tp}) if experts else [tp], (False, True)):
            for mb in divisors(global_batch // dp) if global_batch % dp == 0 else [1]:
                seen += size
                if layout_findings(shape, world=world, global_batch=global_batch, tp=tp, pp=pp, vpp=vpp, cp=cp,
                                   ep=ep, etp=etp, dp=dp, sp=sp, micro_batch=mb):
                    continue
                out.append(Branch((tp, pp, vpp, cp, ep, etp, dp, sp, mb), rcs, memory, tuple(offloads)))
    return seen, out


def enumerate_all(shape: dict, *, world: int, global_batch: int, modules: list[str],
                  offloads: tuple = ((),), optimizer_offload_allowed: bool = False) -> tuple[int, list[Candidate]]:
    """How many combinations were looked at, and every legal candidate (:func:`enumerate_branches`' members)."""
    seen, branches = enumerate_branches(shape, world=world, global_batch=global_batch, modules=modules,
                                        offloads=offloads, optimizer_offload_allowed=optimizer_offload_allowed)
    return seen, [c for branch in branches for c in branch.members()]


def _optimizer_options(shape: dict, distributed: bool, dp_cp: int, offload_allowed: bool) -> list[tuple]:
    """The (FSDP strategy, bf16 moments, optimizer offload share) triples a candidate may take
    (:func:`..levers.fsdp.search_options`, :func:`..levers.optimizer_offload.search_options`)."""
    return [(strategy, moments, share) for strategy, moments in fsdp.search_options(shape, distributed, dp_cp)
            for share in optimizer_offload.search_options(offload_allowed, distributed_optimizer=distributed,
                                                          fsdp=strategy, bf16_moments=moments)]


def settings_for(base, c: Candidate, shape: dict, global_batch: int):
    """The estimate settings ``base`` (of the given config) moved to candidate ``c``: what the step-time model reads
    (the layout, the micro-batch, recompute, the optimizer), to rank candidates before any is estimated."""
    layers = shape["layers"]
    moe = base.moe
    if moe is not None:
        moe_layers = round(moe.layers_on_stage * base.pp)
        moe = replace(moe, ep=c.ep, etp=c.etp, local_experts=moe.experts // c.ep, layers_on_stage=moe_layers // c.pp)
    return replace(base, tp=c.tp, pp=c.pp, vpp=c.vpp, cp=c.cp, dp=c.dp, sequence_parallel=c.sp and c.tp > 1,
                   micro_batch=c.micro_batch, num_microbatches=global_batch // (c.micro_batch * c.dp),
                   layers_on_stage=-(-layers // c.pp), stage=c.pp - 1,
                   recompute_granularity=FULL if c.recompute == FULL else ("selective" if c.recompute else None),
                   recompute_modules=() if c.recompute == FULL else tuple(c.recompute),
                   distributed_optimizer=c.distributed_optimizer, moe=moe, fsdp=c.fsdp,
                   moment_bytes=2 + 2 if c.bf16_moments else 4 + 4, optimizer_offload=c.optimizer_offload,
                   optimizer_offload_overlap=c.optimizer_overlap)
