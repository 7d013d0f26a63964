"""``estimate(cfg)``: the PEFT-aware memory of the most loaded rank of a Bridge training config.

For each pipeline stage that can be the most loaded under the config's split (:mod:`.pipeline`: the first
of each group of stages holding the same layers, embedding and loss), the rank's real model is built from the
config on fake tensors (:mod:`.build`), its parameters are counted (:mod:`.static`), and one microbatch runs
through it under the saved-activation meter (:mod:`.trace`). Each chunk's activations are multiplied by the
forwards of that chunk the pipeline schedule keeps in flight; buffers the forward left allocated are measured; the
transients at the backward peak are formulas. Nothing runs on a device and the model's weights are
never allocated (only a PEFT's adapters, small, while it creates them).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_bridge_ext.estimate import (configs, cuda_graphs, features, fsdp, mamba, muon, offload, phases, pipeline,
                                          precision, routing, static, te, te_fp8, trace_cache, unmodelled)
from megatron_bridge_ext.estimate.build import (ATTENTIONS, FUSED, LOCAL, build_rank_model, is_hybrid, is_moe_kind,
                                                layer_kinds, moe_layer_pattern, set_gpt_layer_kinds, set_layer_kinds,
                                                stage_layer_kinds)
from megatron_bridge_ext.estimate.routing import BALANCED
from megatron_bridge_ext.estimate.report import ACTIVATIONS, BUFFERS, TRANSIENT, Component, MemoryEstimate
from megatron_bridge_ext.estimate.settings import (HybridSettings, MlaSettings, MoeSettings, PeftSettings,
                                                   ReportSettings, Settings)
from megatron_bridge_ext.estimate.features import fp8_experts
from megatron_bridge_ext.estimate.trace import (CATEGORIES, CHECKPOINT_INPUTS, EXPERTS, LORA_INPUTS, layer_of,
                                               moe_layers_of,
                                               trace_microbatch)
from megatron_bridge_ext.findings import ERROR, Finding, Refused
from megatron_bridge_ext.levers import fsdp as fsdp_rules, optimizer_offload
from megatron_bridge_ext.levers.activation_offload import constraints as activation_offload_constraints
from megatron_bridge_ext.levers.parallelism.constraints import (expert_sizes, moe_sequence_parallel_problem,
                                                                query_group_problem, schedule_findings)
from megatron_bridge_ext.levers.recompute import attention as recompute_attention

WHAT = "memory estimate"
DEVICES = ("cuda", "cpu")
TE = "transformer_engine"
IMPLS = (TE, LOCAL)

NOT_MODELLED = ("allocator caching and fragmentation (the plan keeps a margin for it), NCCL buffers and the CUDA "
                "context (outside PyTorch's allocator), CUDA graphs, kernel workspaces (cuBLAS, attention)")


class NotModelled(Refused):
    """The estimate cannot model this config (a hybrid model's other layers, MLA's and CP's variants, FP4, MoE token
    dropping); the config itself may train.

    Raised after the layout checks pass, so that a caller can still show an estimate that models it
    (Bridge's) where a :class:`Refused` for a broken config stops everything.
    """


def _refuse(code: str, setting: str, message: str, fix: str) -> Refused:
    return Refused(WHAT, [Finding(code, ERROR, setting, message, fix)])


def microbatches_in_flight(*, pp: int, vpp: Optional[int], num_microbatches: int, stage: int,
                           group_size: Optional[int] = None) -> float:
    """Microbatches whose activations pipeline stage ``stage`` holds at once, in whole-stage units.

    Megatron Core's schedules (``pipeline_parallel/schedules.py``) run ``warmup`` forwards before the
    first backward and then alternate, so ``warmup + 1`` forwards are alive: 1F1B has
    ``warmup = pp - stage - 1``; the interleaved schedule counts model chunks,
    ``warmup = 2 (pp - stage - 1) + (vpp - 1) * group_size`` (group size defaults to pp), each chunk
    a ``1 / vpp`` share of the stage. Both are capped by the microbatches of the step. For stage 0
    this is Korthikanti et al.'s ``pp (1 + (pp - 1) / (pp vpp))``. Per chunk: :func:`.pipeline.chunk_forwards`.
    """
    forwards = pipeline.chunk_forwards(pp=pp, vpp=vpp, num_microbatches=num_microbatches, stage=stage,
                                       group_size=group_size)
    return sum(forwards) / len(forwards)


@dataclass
class Prepared:
    """A config made ready for building: copies of its parts with Bridge's mixed precision applied."""

    provider: Any
    peft: Any
    optimizer: Any
    ddp: Any
    dtype: torch.dtype
    seq: int
    micro_batch: int
    data_parallel: int
    num_microbatches: int
    notes: list[str]
    reports: ReportSettings
    """What :func:`.phases.predicted_reports` reads of the run (when Bridge prints memory, when CUDA-graph pools
    appear) and the output layer's wgrad deferral limit."""
    resume: bool = False
    """The run loads its optimizer state from ``checkpoint.load`` (:func:`_resumes`): the phases start with it."""
    graph_impl: str = "none"
    """The config's CUDA-graph implementation (the traced copy has them off): :mod:`.cuda_graphs`."""

    @property
    def local_seq(self) -> int:
        """The tokens of a sequence one rank's layers run on: s / CP (:mod:`.features.context_parallel`)."""
        return self.seq // (self.provider.context_parallel_size or 1)


def _training_dtype(model) -> torch.dtype:
    """The dtype ``Float16Module`` casts the model to (fp32 when neither bf16 nor fp16)."""
    if getattr(model, "bf16", False):
        return torch.bfloat16
    if getattr(model, "fp16", False):
        return torch.float16
    return torch.float32


def parallel_problems(model, *, micro_batch: int, peft=None) -> list[Finding]:
    """What the parallel layout cannot do with this model, each naming the setting and the fix."""
    out = []

    def refuse(code, setting, message, fix):
        out.append(Finding(code, ERROR, setting, message, fix))

    tp, pp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", model.context_parallel_size), ("seq_length", model.seq_length)):
        if not value or value < 1:
            refuse("size_below_one", f"model.{name}", f"is {value}", "set it to 1 or more")
    if micro_batch < 1:
        refuse("size_below_one", "train.micro_batch_size", f"is {micro_batch}", "set it to 1 or more")
    for name in configs.SHAPE_FIELDS:
        value = getattr(model, name, None)
        if configs.bad_shape(value):
            refuse("size_below_one", f"model.{name}", f"is {value!r}", configs.shape_fix("it"))
    if out:
        return out
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    heads_problem = query_group_problem(heads, groups, tp)
    checks = [
        (heads_problem, "model.tensor_model_parallel_size", heads_problem),
        (model.ffn_hidden_size and model.ffn_hidden_size % tp, "model.tensor_model_parallel_size",
         f"TP={tp} does not divide the FFN size {model.ffn_hidden_size}"),
        (model.vocab_size and not getattr(model, "should_pad_vocab", False) and model.vocab_size % tp,
         "model.tensor_model_parallel_size", f"TP={tp} does not divide the vocabulary {model.vocab_size}"),
        (model.sequence_parallel and tp > 1 and (model.seq_length // model.context_parallel_size) % tp,
         "model.seq_length", f"sequence {model.seq_length} / CP={model.context_parallel_size} is not divisible by "
                             f"TP={tp} (sequence parallelism splits a CP rank's tokens)"),
    ]
    if is_hybrid(model):
        checks += _hybrid_split_checks(model, pp)
    dim = getattr(peft, "dim", None)
    if dim and tp > 1:
        checks.append((dim % tp, "peft.dim", f"LoRA rank {dim} is not divisible by TP={tp} (Bridge shards LoRA-A on it)"))
    if is_hybrid(model) and unmodelled.MAMBA in layer_kinds(model):
        checks += mamba.layout_checks(model, tp, model.context_parallel_size or 1)
    checks += features.gated_delta_net.layout_checks(model)
    for failed, setting, message in checks:
        if failed:
            refuse("parallel_layout", setting, message, "choose sizes that divide it")
    out += features.context_parallel.layout_findings(model)
    if not is_hybrid(model):
        out += pipeline.split_problems(model)
    moe_sp = moe_sequence_parallel_problem(experts=getattr(model, "num_moe_experts", None), tp=tp,
                                           sp=bool(model.sequence_parallel))
    if moe_sp:
        refuse("parallel_layout", "model.sequence_parallel", moe_sp, "set model.sequence_parallel=True")
    return out


def _hybrid_split_checks(model, pp: int) -> list:
    """A hybrid model's stages: its segments (``|`` marks), or an even split unless the first or last stage's count
    is given (:func:`..unmodelled.pipeline_segments`)."""
    checks = [(model.num_layers % pp and not (model.num_layers_in_first_pipeline_stage
                                              or model.num_layers_in_last_pipeline_stage) and not _piped(model),
               "model.pipeline_model_parallel_size", f"PP={pp} does not divide the {model.num_layers} layers")]
    segments = unmodelled.pipeline_segments(model) if _piped(model) else None
    if segments is not None and len(segments) != pp:
        checks.append((True, "model.hybrid_layer_pattern",
                       f"its {len(segments)} pipeline segments ('|' marks) are not PP={pp} (Megatron Core gives each "
                       "stage one segment)"))
    vpp = model.virtual_pipeline_model_parallel_size
    if vpp and vpp > 1:
        checks.append(((model.num_layers // pp) % vpp, "model.virtual_pipeline_model_parallel_size",
                       f"VPP={vpp} does not divide the {model.num_layers // pp} layers of a stage"))
    return checks


def _piped(model) -> bool:
    """A hybrid model whose pattern marks its pipeline stages with ``|``."""
    return unmodelled.PIPE in (unmodelled.main_pattern(model) or "")


FP4_GPUS = ("Transformer Engine runs NVFP4 only on compute capability 10.0 and up (Blackwell): on Hopper the run "
            "fails when Core enters the FP4 autocast (TE v2.8 pytorch/fp8.py L57-61, L508-510; Core fp4_utils.py "
            "L273-276)")
"""Why an FP4 recipe named for H100 does not run there either: said with the refusal."""


def _fp4(setting: str) -> Finding:
    return Finding("unsupported_model", ERROR, setting, f"FP4 training is not modelled by the estimate; {FP4_GPUS}",
                   "estimate the bf16 or FP8 config")


def _unsupported(model) -> list[Finding]:
    out = unmodelled.hybrid_findings(model) + features.findings(model)
    if getattr(model, "fp4", None):
        out.append(_fp4("model.fp4"))
    if getattr(model, "fp8", None) and getattr(model, "fp8_recipe", None) not in precision.RECIPES:
        out.append(Finding("unsupported_model", ERROR, "model.fp8_recipe",
                           f"FP8 recipe {model.fp8_recipe!r} is not modelled by the estimate",
                           f"use one of {', '.join(precision.RECIPES)}"))
    return out


UNHONOURED = (
    ("ddp", "use_custom_fsdp", "the deprecated flag is read nowhere in Megatron Core 0.19 "
     "(distributed_data_parallel_config.py L93-98): Megatron-FSDP is ddp.use_megatron_fsdp"),
)
"""Optimizer and DDP settings the estimate cannot honour: each is refused by name rather than estimated without it."""


def _te_release_for_fp8_experts(provider):
    """Core's config check that FP8 on MoE layers has TE >= 1.7.0 (``transformer_config.py`` L2294-2300) answered for
    the modelled TE release (:func:`.te.version_checks_of_the_modelled_release`), as on a cluster that has it: the
    experts' FP8 is modelled by TE's contract (:mod:`.features.fp8_experts`), not run here."""
    if not (getattr(provider, "fp8", None) and getattr(provider, "num_moe_experts", None)):
        return contextlib.nullcontext()
    from megatron.core.transformer import transformer_config

    return te.version_checks_of_the_modelled_release(transformer_config)


def _unhonoured(optimizer, ddp, dtype: torch.dtype) -> list[Finding]:
    """The table's settings, then the optimizer's: an optimizer other than Adam/SGD, the CPU offload's limits."""
    sections = {"optimizer": optimizer, "ddp": ddp}
    grad_16 = not getattr(ddp, "grad_reduce_in_fp32", False) and dtype != torch.float32
    return ([Finding("unsupported_model", ERROR, f"{section}.{name}", what, f"estimate with {section}.{name}=false")
             for section, name, what in UNHONOURED if getattr(sections[section], name, False)]
            + static.optimizer_findings(optimizer)
            + optimizer_offload.findings(optimizer, ddp, grad_bytes_16=grad_16))


def prepare(cfg, *, data_parallel_size: Optional[int], num_microbatches: Optional[int],
            modelled_only: bool = True, resume: bool = False) -> Prepared:
    """Copies of the config's parts, checked and finalized as training would; ``modelled_only``: refuse (with
    :class:`NotModelled`) what this estimate cannot model, which Bridge's formula-based estimate can read;
    ``resume``: the run loads optimizer state from a checkpoint (:func:`_resumes`)."""
    provider, optimizer, ddp = copy.deepcopy(cfg.model), copy.deepcopy(cfg.optimizer), copy.deepcopy(cfg.ddp)
    notes = []
    if cfg.mixed_precision is not None:
        mixed = precision.mixed_precision_of(cfg)
        if modelled_only and mixed.fp4:  # before finalize, which refuses FP4 where TE is not installed (here)
            raise NotModelled(WHAT, [_fp4("mixed_precision")])
        mixed.finalize()
        mixed.setup(provider, optimizer, ddp)
    notes += _sync_distributed_optimizer(optimizer, ddp)
    fsdp_problems, fsdp_unmodelled = fsdp_rules.findings(cfg, provider, optimizer, ddp, te_version=te.MODELLED_VERSION)
    if fsdp_rules.enabled(ddp, getattr(cfg, "dist", None)):
        notes += fsdp_rules.bridge_applies(optimizer, ddp)
    _apply_comm_overlap(cfg, provider, optimizer, ddp,
                        data_parallel=data_parallel_size or getattr(cfg, "data_parallel_size", None) or 1)
    micro_batch = cfg.train.micro_batch_size
    problems = parallel_problems(provider, micro_batch=micro_batch, peft=cfg.peft)
    problems += [p for p in [unmodelled.cuda_graph_problem(provider)] if p]
    problems += activation_offload_constraints.findings(provider)
    problems += features.latent_moe.config_problems(provider)
    problems += features.recipe_attention.packed_findings(provider, cfg) + fsdp_problems
    if problems:
        raise Refused(WHAT, problems)
    not_modelled = (_unsupported(provider) + features.mla.peft_findings(provider, cfg.peft)
                    + features.expert_offload.peft_findings(provider, cfg.peft)
                    + _unhonoured(optimizer, ddp, _training_dtype(provider)) + fsdp_unmodelled) if modelled_only else []
    if not_modelled:
        raise NotModelled(WHAT, not_modelled)
    reports = _report_settings(cfg, provider)
    notes += _set_wgrad_deferral_apart(provider, reports.wgrad_deferral_limit)
    graphs, graph_impl = phases.cuda_graph_note(provider), cuda_graphs.impl_of(provider)
    notes += _local_spec_kernels(provider) + unmodelled.drop_cuda_graphs(provider) + ([graphs] if graphs else [])
    notes += precision.notes(precision.fp8_of(provider))
    try:
        with _te_release_for_fp8_experts(provider):
            provider.finalize()
    except (AssertionError, ValueError, TypeError) as error:
        raise _refuse("model_config", "model", f"Megatron Core refuses the model config: {error}",
                      "fix the model fields it names") from None
    dp = data_parallel_size or getattr(cfg, "data_parallel_size", None)
    if not dp:
        dp = 1
        notes.append("data-parallel size unknown (the config was not validated for a world size): DP=1 assumed; "
                     "it only divides the distributed optimizer's states")
    if num_microbatches is None:
        global_batch = cfg.train.global_batch_size or micro_batch * dp
        num_microbatches = max(1, global_batch // (micro_batch * dp))
    schedule = schedule_findings(pp=provider.pipeline_model_parallel_size,
                                 vpp=provider.virtual_pipeline_model_parallel_size, num_microbatches=num_microbatches,
                                 group=getattr(provider, "microbatch_group_size_per_vp_stage", None))
    if schedule:
        raise Refused(WHAT, schedule)
    resume, note = _resumes(getattr(cfg, "checkpoint", None), resume)
    if resume and modelled_only and fsdp_rules.enabled(ddp):
        raise NotModelled(WHAT, [Finding(
            "unsupported_model", ERROR, "resume", "the optimizer-state load of Megatron-FSDP (fsdp_dtensor, "
            "distrib_optimizer.py L916-925) is not modelled", "estimate without resume")])
    if resume and modelled_only and not getattr(optimizer, "use_distributed_optimizer", False):
        raise NotModelled(WHAT, [Finding(
            "unsupported_model", ERROR, "resume", "the optimizer-state load of the non-distributed optimizer is not "
            "modelled (its init_state_fn states, optimizer.py L1145-1146, then the checkpoint's)",
            "estimate without resume, or with use_distributed_optimizer=true")])
    return Prepared(provider, cfg.peft, optimizer, ddp, _training_dtype(provider), provider.seq_length, micro_batch,
                     dp, num_microbatches, notes + ([note] if note else []), reports, resume, graph_impl)


def _resumes(checkpoint, asked: bool) -> tuple[bool, Optional[str]]:
    """Whether the run loads optimizer state (``asked``, and the config lets it), and the note saying why.

    Bridge loads it from ``checkpoint.load`` unless ``finetune`` or ``load_optim=False`` (training/checkpointing.py
    L2787-2792); a ``pretrained_checkpoint`` alone turns ``finetune`` on (L2292-2306). Recipes set ``load`` to their
    own save directory (recipes/common.py L120), empty on a first launch (setup.py L154-190 looks), so the config
    alone does not say that a run resumes: the caller does."""
    load = getattr(checkpoint, "load", None)
    loads_optimizer = bool(load) and getattr(checkpoint, "load_optim", True) and not getattr(checkpoint, "finetune",
                                                                                             False)
    if asked and loads_optimizer:
        return True, (f"resumed from checkpoint.load={load!r}: the phases start with the load of its optimizer state "
                      f"({phases.RESUME}), and iteration 1 has the loaded moments")
    if asked:
        return False, ("resume asked, but the config loads no optimizer state (checkpoint.load unset, "
                       "finetune or load_optim=false): estimated as a fresh run")
    return False, None


def _sync_distributed_optimizer(optimizer, ddp) -> list[str]:
    """The distributed optimizer as Bridge's validation leaves it: on for both configs when either has it on
    (``_validate_and_sync_distributed_optimizer_settings``, training/config.py L1945-1967); a note when they
    disagreed, since turning one off alone changes nothing in the run."""
    settings = (bool(getattr(optimizer, "use_distributed_optimizer", False)),
                bool(getattr(ddp, "use_distributed_optimizer", False)))
    if not any(settings) or all(settings):
        return []
    optimizer.use_distributed_optimizer = ddp.use_distributed_optimizer = True
    return [f"optimizer.use_distributed_optimizer={settings[0]} and ddp.use_distributed_optimizer={settings[1]}: "
            "Bridge's validation turns the distributed optimizer on for both (training/config.py L1945-1967), as "
            "estimated; set both to false for a non-distributed optimizer"]


def _apply_comm_overlap(cfg, provider, optimizer, ddp, *, data_parallel: int) -> None:
    """``cfg.comm_overlap`` written into the copies as Bridge writes it at start-up (training/config.py L1884-1885:
    ``finalize()`` then ``setup(model, optimizer, ddp)``): ``defer_embedding_wgrad_compute``,
    ``wgrad_deferral_limit``, ``overlap_param_gather_with_optimizer_step`` and the rest reach the model and DDP
    configs only so."""
    overlap = getattr(cfg, "comm_overlap", None)
    if overlap is None:
        return
    overlap = copy.deepcopy(overlap)
    overlap.data_parallel_size = data_parallel  # as ConfigContainer.validate sets it first (training/config.py L1041)
    from megatron.bridge.training import comm_overlap

    try:
        with te.version_checks_of_the_modelled_release(comm_overlap), _root_warnings_off():
            overlap.finalize()
            overlap.setup(provider, optimizer, ddp)
    except (AssertionError, ValueError, TypeError, ImportError) as error:
        raise _refuse("model_config", "comm_overlap", f"Bridge's CommOverlapConfig.setup refuses it: "
                      f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}",
                      "fix the comm_overlap fields it names") from None


@contextlib.contextmanager
def _root_warnings_off():
    """Bridge's setup logs what it changes on the root logger ("Disabling tensor parallel communication overlap ...",
    comm_overlap.py L444-447); on the estimate's copies it is said again for every stage estimated, and the run
    itself says it once: quiet here."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def _set_wgrad_deferral_apart(provider, limit: Optional[int]) -> list[str]:
    """Keep ``defer_embedding_wgrad_compute`` for its formula (:func:`.phases.wgrad_deferral_component`) and turn
    it off on the traced copy: Core requires gradient-accumulation fusion with it (model_parallel_config.py
    L550-553), whose kernel (TE or Apex) Bridge turns off where neither is installed, as here. ``limit``: the
    deferral's limit (:func:`_wgrad_deferral_limit`), None without the deferral."""
    if limit is None:
        return []
    if provider.pipeline_model_parallel_size == 1 or limit < 0:
        raise _refuse("model_config", "model.defer_embedding_wgrad_compute",
                      f"is on with PP={provider.pipeline_model_parallel_size} and wgrad_deferral_limit="
                      f"{limit}: Megatron Core refuses it without pipeline parallelism or "
                      "with a negative limit (model_parallel_config.py L545-558)",
                      "use PP > 1 and a limit of 0 (every microbatch) or more, or model.defer_embedding_wgrad_compute=false")
    provider.defer_embedding_wgrad_compute = False
    return ["defer_embedding_wgrad_compute: the output layer's deferred inputs and output gradients on the last stage "
            "are a formula (estimate.phases); the layer itself is traced without the deferral"]


def _wgrad_deferral_limit(provider) -> Optional[int]:
    """The model's ``wgrad_deferral_limit`` (0 when unset) under ``defer_embedding_wgrad_compute``, else None."""
    if not getattr(provider, "defer_embedding_wgrad_compute", False):
        return None
    return getattr(provider, "wgrad_deferral_limit", 0) or 0


def _report_settings(cfg, provider) -> ReportSettings:
    """The settings that decide when Bridge prints memory, when CUDA-graph pools appear and what the last stage
    defers."""
    logger, train = getattr(cfg, "logger", None), getattr(cfg, "train", None)
    impl = getattr(provider, "cuda_graph_impl", None) or "none"
    return ReportSettings(log_interval=getattr(logger, "log_interval", 1) or 1,
                          train_iters=getattr(train, "train_iters", None),
                          cuda_graph_first_iteration=(getattr(provider, "cuda_graph_warmup_steps", 0) or 0) + 1
                          if impl != "none" else None,
                          wgrad_deferral_limit=_wgrad_deferral_limit(provider))


# Kernel choices of Transformer Engine or Apex that the local layer spec refuses, and what tracing
# without them means for the saved bytes.
_TE_KERNEL_FLAGS = (
    ("apply_rope_fusion", "RoPE fusion needs Transformer Engine: traced unfused, which keeps cos and sin per layer "
                          "where TE's fused RoPE keeps only the frequencies"),
    ("persist_layer_norm", "persistent LayerNorm (an Apex/TE kernel) traced with torch's norm: same saved tensors"),
    ("layernorm_zero_centered_gamma", "zero-centred norm weights (TE) traced with torch's norm: same saved tensors"),
    ("moe_permute_fusion", "fused MoE token permutation needs Transformer Engine: read unfused, which no formula "
                           "of Bridge's estimate depends on"),
)
_NEED_TE = ("apply_rope_fusion", "moe_permute_fusion")
"""The flags above that only Transformer Engine's absence makes Megatron Core refuse."""


def _local_spec_kernels(provider) -> list[str]:
    """Turn off, on the copy that is traced, kernel flags the local spec refuses; say what that changes."""
    notes = [note for note in (features.mla.turn_off_rope_fusion(provider),
                               features.dsa.turn_off_fused_kernels(provider)) if note]
    for flag, note in _TE_KERNEL_FLAGS:
        if getattr(provider, flag, False) and (flag not in _NEED_TE or not _have_te()):
            setattr(provider, flag, False)
            notes.append(f"{flag}: {note}")
    return notes


def _have_te() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def _choice(value, choices, setting):
    if value not in choices:
        raise _refuse("unknown_choice", setting, f"{value!r} is not one of {list(choices)}", f"use one of {list(choices)}")
    return value


def _attention_from(model) -> str:
    """What the model builds, by the rule ``MemoryConfig.validate`` uses too (one rule, one answer)."""
    return FUSED if recompute_attention.attention_kind_from_config(model).kind == recompute_attention.FUSED else LOCAL


def estimate(cfg, *, data_parallel_size: Optional[int] = None, num_microbatches: Optional[int] = None,
             attention: Optional[str] = None, transformer_impl: Optional[str] = None,
             device: str = "cuda", moe_imbalance: float = BALANCED, resume: bool = False) -> MemoryEstimate:
    """Per-rank memory of the most loaded pipeline stage of a Bridge ``ConfigContainer`` at its backward peak.

    ``attention``: ``"fused"`` traces a stand-in that keeps what fused (flash/cuDNN) attention keeps,
    ``"local"`` Megatron Core's unfused attention; default: what the model's layer spec and
    ``attention_backend`` build (:func:`megatron_bridge_ext.levers.recompute.attention.attention_kind_from_config`).
    ``transformer_impl``: ``"transformer_engine"`` adds what TE's fused norm-linear keeps beyond the
    traced local spec; default ``model.transformer_impl``. ``device``: the dispatch path traced,
    ``"cuda"`` (fake CUDA tensors, no GPU needed) for GPU estimates, ``"cpu"`` to compare with CPU runs.
    ``data_parallel_size`` defaults to ``cfg.data_parallel_size`` (set when Bridge validates the
    config), ``num_microbatches`` to global batch / (micro-batch x DP).
    ``moe_imbalance`` (MoE models): the tokens of the traced rank's experts over the balanced share,
    1.0 (balanced) or more (:mod:`.routing`). ``resume``: the run loads optimizer state from ``checkpoint.load``
    (a phase for the load, :func:`.phases.load_transients`).
    Raises :class:`megatron_bridge_ext.findings.Refused` (one line per problem) for configs it cannot model.
    """
    start = time.perf_counter()
    problem = configs.imbalance_problem(moe_imbalance)
    if problem:
        raise Refused(WHAT, [problem])
    prepared = prepare(cfg, data_parallel_size=data_parallel_size, num_microbatches=num_microbatches, resume=resume)
    problem = _imbalance_beyond_tokens(prepared.provider, moe_imbalance)
    if problem:
        raise Refused(WHAT, [problem])
    attention = _choice(attention or _attention_from(prepared.provider), ATTENTIONS, "attention")
    impl = _choice(transformer_impl or getattr(prepared.provider, "transformer_impl", TE), IMPLS, "transformer_impl")
    device = _choice(device, DEVICES, "device")
    problems = _te_problems(prepared, impl)
    if problems:
        raise Refused(WHAT, problems)
    problems = features.mla.layout_findings(prepared.provider, transformer_impl=impl)
    if problems:
        raise Refused(WHAT, problems)
    problems = features.mla.trace_findings(prepared.provider, attention=attention, transformer_impl=impl, fused=FUSED)
    problems += features.context_parallel.trace_findings(prepared.provider, attention=attention, fused=FUSED)
    problems += features.recipe_attention.trace_findings(prepared.provider, attention=attention, fused=FUSED)
    if problems:
        raise NotModelled(WHAT, problems)
    stages = candidate_stages(prepared.provider)
    results = [_estimate_stage(prepared, stage, attention=attention, impl=impl, device=device,
                               imbalance=float(moe_imbalance), candidates=stages) for stage in stages]
    best = max(results, key=lambda r: r.peak_bytes)
    best.stage_peaks = {r.stage: r.peak_bytes for r in results}
    best.stage_phase_peaks = {r.stage: {p.name: (p.peak_bytes, p.after_bytes) for p in r.phases} for r in results}
    best.stage_graph_pools = {r.stage: phases.graph_pool(r) for r in results}
    best.seconds = time.perf_counter() - start
    return best


def _imbalance_beyond_tokens(provider, imbalance: float) -> Optional[Finding]:
    """A load factor that would send an expert more tokens than there are: each token picks an expert once, so
    an expert receives at most every token, experts / top-k times the balanced share."""
    experts = getattr(provider, "num_moe_experts", None)
    if not experts or imbalance <= experts / provider.moe_router_topk:
        return None
    most = experts / provider.moe_router_topk
    return Finding("bad_input", ERROR, "moe_imbalance", f"{imbalance:g} sends an expert more tokens than there are "
                   f"(at most experts / top-k = {experts} / {provider.moe_router_topk} = {most:g} times the balanced "
                   "share)", f"give a load factor between 1 and {most:g}")


def _te_problems(prepared: Prepared, impl: str) -> list[Finding]:
    """Configs that fail in training on Transformer Engine, so that no estimate of them means anything."""
    from megatron_bridge_ext.peft import kinds

    peft, p = prepared.peft, prepared.provider
    if impl != TE or peft is None or not (p.sequence_parallel and p.tensor_model_parallel_size > 1):
        return []
    targets = kinds.targeted_layers(getattr(peft, "target_modules", None) or [])
    if kinds.kind_of(peft) == "dora" and (getattr(peft, "dropout", 0) or 0) > 0 and targets & set(te.COLUMN_TARGETS):
        return [Finding("unsupported_model", ERROR, "peft.dropout",
                        f"DoRA with dropout={peft.dropout} fails on Transformer Engine's LayerNorm-linear under sequence "
                        "parallelism (Bridge's dropout correction runs that layer again on its gathered norm output)",
                        "set peft.dropout=0.0, or leave linear_qkv and linear_fc1 out of peft.target_modules")]
    return []


def candidate_stages(provider) -> list[int]:
    """The pipeline stages estimated: every stage of a hybrid model (its segments need not hold equal layers), else
    the first stage of each group that holds the same chunks (:func:`.pipeline.candidate_stages`): a layer's kind,
    its number where its build depends on it (:data:`LAYER_NUMBER_FIELDS`), whether it runs in FP8, whether it
    computes its sparse attention's top-k (:func:`..features.dsa.index_shared`)."""
    pp = provider.pipeline_model_parallel_size
    if is_hybrid(provider):
        return list(range(pp))
    kinds = layer_kinds(provider)
    if not _uniform_dense(provider):
        kinds = list(range(provider.num_layers))
    fp8 = precision.fp8_of(provider)
    if fp8 is not None:
        kinds = [(kind, fp8.layer_in_fp8(number)) for number, kind in enumerate(kinds)]
    if features.dsa.index_shared(provider):
        kinds = [(kind, features.dsa.source_of(provider, number) == number) for number, kind in enumerate(kinds)]
    return pipeline.candidate_stages(provider, kinds)


TRACED_LAYERS = 2
"""Layers of a stage of identical MoE layers it is traced with (:func:`traced_layers`): the first, and one that stands
for the rest."""


@dataclass(frozen=True)
class ReducedStage:
    """A stage traced with fewer layers: ``pattern`` (1 MoE, 0 dense) of the layers built and traced, and for each
    layer of the real stage the traced layer whose saves and parameters it has (``sources``); ``numbers``: the
    traced layers' real 0-based global numbers where the build must keep them (DeepSeek sparse attention's shared
    top-k, :func:`_index_shared_prefix`), else None."""

    pattern: list[int]
    sources: list[int]
    numbers: Optional[list[int]] = None


def traced_layers(provider, stage: int = 0) -> Optional[ReducedStage]:
    """How a stage can be traced with a few layers (an MoE, hybrid or :func:`_uniform_dense` model's); None: every
    layer is traced.

    An MoE layer traces each of its local experts (dozens), so a whole stage takes minutes; a dense stage of 36
    layers takes seconds, once per option of the plan. Every layer after the
    first saves what a later layer of the same kind (dense, MoE, or a hybrid model's Mamba, attention, MLP, MoE:
    the same spec) saves: its input is the previous layer's fresh output whatever that layer's kind. So the stage
    is traced as its first layer, then one layer of each kind that follows, in the order they first follow (at
    least :data:`TRACED_LAYERS` layers), and each later layer repeats the last traced layer of its kind. Any
    pipeline split Core accepts is read so (:func:`..build.stage_layer_kinds`: a stage's layers, chunk after chunk
    under an interleaved split, the embedding and loss where Core builds them). Under full recompute only with one
    layer per checkpoint (``uniform``, ``recompute_num_layers=1``), each checkpoint counted as its layer's
    (:func:`.trace.checkpoints_by_layer`); not with chunks of several layers or the ``block`` method (layers then
    differ by their number), nor on a hybrid stack.
    """
    hybrid = is_hybrid(provider)
    layers = stage_layer_kinds(provider, stage)
    if (not (getattr(provider, "num_moe_experts", None) or hybrid or _uniform_dense(provider))
            or len(layers) <= TRACED_LAYERS or (provider.recompute_granularity == "full"
                                                and not (_one_layer_checkpoints(provider) and not hybrid))):
        return None
    if features.dsa.index_shared(provider) and not hybrid:
        return _index_shared_prefix(provider, stage, layers)
    pattern = [layers[0]] + list(dict.fromkeys(layers[1:]))
    pattern += pattern[-1:] * (TRACED_LAYERS - len(pattern))
    last = {kind: index for index, kind in enumerate(pattern)}
    return ReducedStage(pattern, [0] + [last[kind] for kind in layers[1:]])


def _one_layer_checkpoints(provider) -> bool:
    """Full recompute that checkpoints every layer alone (Core's ``uniform`` method, one layer a chunk: recompute.py
    L157-165)."""
    return provider.recompute_method == "uniform" and provider.recompute_num_layers == 1


def _index_shared_prefix(provider, stage: int, layers: list) -> ReducedStage:
    """A stage of DeepSeek sparse attention with shared top-k, traced as its first layers with their real numbers:
    a layer that reuses another's top-k saves no indexer (dsa.py L1962-1976) and needs its source built before it,
    so the stage's kinds are (dense/MoE, computes its top-k), and the traced layers are the shortest run from the
    stage's first layer (which computes its own, :func:`..features.dsa.sharing_problems`) holding every kind that
    follows; each later layer repeats the last traced layer of its kind."""
    numbers = pipeline.stage_layers(provider, stage)
    keys = [(kind, features.dsa.source_of(provider, layer) == layer) for kind, layer in zip(layers, numbers)]
    wanted = set(keys[1:])
    count = next(n for n in range(TRACED_LAYERS, len(keys) + 1) if set(keys[1:n]) >= wanted)
    last = {key: index for index, key in enumerate(keys[:count]) if index}
    sources = list(range(count)) + [last[key] for key in keys[count:]]
    return ReducedStage(layers[:count], sources, numbers[:count])


LAYER_NUMBER_FIELDS = ("window_attn_skip_freq", "no_rope_freq", "cpu_offloading")
"""Fields under which a dense model's layers differ by their number in what they save (Megatron Core's
``TransformerConfig``: a sliding window or RoPE skipped every few layers, layers offloaded to the CPU): such a stage
is traced whole. FP8 with the first and last layers in bf16 is not one of them: the traced layers save the same, and
which layers run in FP8 (their weights, TE's contract) is read by each real layer's global number after the trace
(:func:`global_layer_numbers`), as for an MoE stage. Nor is fine-grained activation offloading: every layer opens
the same offload groups whatever its number (transformer_layer.py L1439-1456), and which groups the steady state keeps
on the GPU is read off the real stage's groups, extended from the traced ones (:func:`..features.activation_offload.
extended`)."""


def _uniform_dense(provider) -> bool:
    """A dense model whose layers are one spec built alike, so its later layers save what its second saves (traced
    with :data:`TRACED_LAYERS` layers, as an MoE stage is, instead of every layer: the plan traces a config once
    per option)."""
    return not any(getattr(provider, name, None) for name in LAYER_NUMBER_FIELDS)


def _estimate_stage(prepared: Prepared, stage: int, *, attention: str, impl: str, device: str,
                    imbalance: float = BALANCED, candidates: tuple = ()) -> MemoryEstimate:
    from megatron_bridge_ext.estimate.fake import ranks_per_stage

    provider = prepared.provider
    tp, cp = provider.tensor_model_parallel_size, provider.context_parallel_size
    ep, etp = expert_sizes(provider)
    sp = bool(provider.sequence_parallel) and tp > 1
    rank = stage * ranks_per_stage(tp=tp, cp=cp, ep=ep, etp=etp)  # TP, CP and EP rank 0 of the stage
    load = routing.RoutedLoad(imbalance, capacity_factor=getattr(provider, "moe_expert_capacity_factor", None),
                              pad_to_capacity=bool(getattr(provider, "moe_pad_expert_input_to_capacity", False)))
    hybrid = is_hybrid(provider)
    reduced = traced_layers(provider, stage)
    key = trace_cache.key(provider, prepared, stage, reduced, attention=attention, impl=impl, device=device,
                          imbalance=imbalance)
    model, traced, routed, vocab_local, recomputed_layer = trace_cache.get_or_trace(
        key, lambda: _trace_stage(prepared, stage, reduced, rank=rank, load=load, attention=attention, impl=impl,
                                  device=device))
    layers = len(model.decoder.layers)
    moe_layers = sum(layer_of(name) is not None for name in moe_layers_of(model))  # not MTP's
    if reduced:
        if traced.by_category_and_layer.get((CHECKPOINT_INPUTS, None)):
            raise RuntimeError("full recompute's checkpoints were not counted by layer (trace.checkpoints_by_layer): "
                               "the reduced stage cannot be extended")
        traced = traced.extended(reduced.sources)
        layers = len(reduced.sources)
        moe_layers = sum(is_moe_kind(reduced.pattern[source]) for source in reduced.sources)
    counts = static.count_parameters(model, reduced.sources if reduced else None)
    fp8 = precision.fp8_of(provider)  # the whole model's layers: a reduced stage's copy has fewer
    in_flight = _in_flight(provider, prepared, stage, layers)
    element = static.dtype_bytes(prepared.dtype)
    global_layers = global_layer_numbers(provider, stage, model)
    sources = reduced.sources if reduced else None
    if fsdp_rules.enabled(prepared.ddp):
        components, step = _fsdp_static(prepared, model, sources, counts.element_size)
    else:
        components, step = _static(prepared, counts,
                                   precision.fp8_weights(model, fp8, global_layers, sources) if fp8 else None, fp8)
    in_fp8 = _fp8_layers(global_layers, fp8)
    modelled = fp8 is not None and not te_fp8.refused(fp8)  # TE's quantised shard replaces the bf16 one
    contract = te.TeContract(0, 0, 0, 0)
    if impl == TE and prepared.peft is not None:
        contract = te.norm_output_contract(traced.lora_a_saved, seq=prepared.local_seq,
                                           micro_batch=prepared.micro_batch,
                                           hidden=provider.hidden_size, tp=tp, sequence_parallel=sp,
                                           element_size=element,
                                           quantised=lambda base: modelled and in_fp8(layer_of(base)))
    fp8_acts = None
    if fp8 is not None:  # FP8 linears are Transformer Engine's whatever spec is traced
        fp8_acts = te_fp8.contract(traced, fp8, _fp8_shapes(provider, prepared, sp), in_fp8,
                                   norm_linears=not _recomputes_layernorm(provider))
        fp8_moe = [i for i in _moe_layer_indices(model, reduced) if in_fp8(i)]
        experts = _fp8_experts(model, fp8, routed, element, fp8_moe)
        if fp8_acts is not None and experts is not None:
            fp8_acts = te_fp8.with_experts(fp8_acts, EXPERTS, experts)
    components += _activations(traced, in_flight, contract, fp8_acts)
    graphs = _graph_buffers(provider, prepared, stage, in_flight, element=element, sp=sp)
    in_flight = in_flight.mean
    components += features.activation_offload.components(traced.offload_groups, provider, in_flight)
    tokens = prepared.local_seq // tp if sp else prepared.local_seq
    shard_shape = f"[{tokens}, {prepared.micro_batch}, {provider.hidden_size}]"
    if contract.layers:
        components.append(te.te_component(contract, in_flight, shard_shape=shard_shape))
    if fp8_acts is not None and fp8_acts.lora_shards:
        components.append(te_fp8.lora_component(fp8_acts, in_flight, fp8, shard_shape=shard_shape))
    if traced.persistent_buffer_bytes:
        components.append(Component(BUFFERS, "global memory buffer", traced.persistent_buffer_bytes,
                                    "measured: Megatron's reusable buffer for sequence-parallel all-gathers, "
                                    "allocated by the forward and kept"))
    kinds = set(stage_layer_kinds(provider, stage) if hybrid else layer_kinds(provider))
    components += _transients(provider, prepared, element=element, vocab_local=vocab_local, sp=sp,
                              recomputed_layer=recomputed_layer, routed=routed,
                              dense_layers=unmodelled.MLP in kinds if hybrid else layers > moe_layers,
                              mamba_layers=hybrid and unmodelled.MAMBA in kinds,
                              gdn_layers=features.gated_delta_net.used(provider)
                              and any(kind[1] for kind in stage_layer_kinds(provider, stage)))
    deferred = phases.wgrad_deferral_component(provider, limit=prepared.reports.wgrad_deferral_limit,
                                               seq=prepared.local_seq, micro_batch=prepared.micro_batch,
                                               vocab_local=vocab_local, element=element,
                                               num_microbatches=prepared.num_microbatches)
    components += [deferred] if deferred else []
    settings = _settings(prepared, attention=attention, impl=impl, device=device, stage=stage, layers=layers,
                         moe=_moe_settings(provider, imbalance=imbalance, routed=routed, moe_layers=moe_layers))
    return MemoryEstimate(stage=stage, components=components, settings=settings, step=step,
                          assumptions=_assumptions(prepared, attention, impl, device, contract, candidates)
                          + te_fp8.assumptions(fp8_acts)
                          + _moe_assumptions(provider, imbalance, routed)
                          + [a for a in [features.activation_offload.assumption(traced.offload_groups, provider,
                                                                                 in_flight)] if a]
                          + [a for a in [offload.assumption(prepared.optimizer, host=step.offloaded,
                                                            elements=step.elements)] if a],
                          activations_per_microbatch=dict(traced.by_category), in_flight_microbatches=in_flight,
                          activations_per_layer=dict(traced.by_layer),
                          offload_host_bytes=features.activation_offload.host_bytes(traced.offload_groups, provider),
                          graph_buffers=graphs)


def _trace_stage(prepared: Prepared, stage: int, reduced: Optional[ReducedStage], *, rank: int, load, attention: str,
                 impl: str, device: str) -> tuple:
    """Build and trace ``stage`` of the prepared config in its fake world: the model, what one microbatch saves (of
    the traced layers, before a reduced stage is extended), the tokens routed to the traced experts, the output
    layer's local vocabulary and a full-recompute layer's bytes (:mod:`.trace_cache` keeps them for reuse)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from megatron_bridge_ext.estimate.fake import fake_parallel_world

    provider = prepared.provider
    tp, pp, cp = provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size, provider.context_parallel_size
    ep, etp = expert_sizes(provider)
    sp = bool(provider.sequence_parallel) and tp > 1
    hybrid = is_hybrid(provider)
    with fake_parallel_world(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, rank=rank, device=device), \
            routing.balanced_routing(load), routing.in_order_streams(), features.kernels(), _te_checks_in_the_loss(), \
            (mamba.mamba_kernels() if hybrid else contextlib.nullcontext()), \
            (features.context_parallel.rope_chunks_on_the_traced_device() if cp > 1 else contextlib.nullcontext()), \
            (features.flex.deepep_kernels(load, provider) if features.flex.used(provider) else contextlib.nullcontext()), \
            (features.hybridep.hybridep_kernels(load, provider) if features.hybridep.used(provider)
             else contextlib.nullcontext()), features.token_dropping.padded_counts_on_host(provider), \
            (features.dsa.indexer_loss_tracker() if features.dsa.used(provider) else contextlib.nullcontext()), \
            (features.dsa.cp_lengths_by_shape() if features.dsa.used(provider) and cp > 1 else contextlib.nullcontext()):
        # A ShapeEnv lets the vocabulary-parallel embedding and loss mask rows by boolean indexing.
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        stage_provider = copy.deepcopy(provider)
        if reduced:
            set_layer_kinds(stage_provider, reduced.pattern)
        elif not hybrid and not pipeline.is_plain(provider):
            _one_chunk_per_stage(stage_provider, provider)
        with (features.mtp.final_norm_on_stage(pipeline.final_norm_chunk(provider, stage) is not None)
              if features.mtp.used(provider) and not hybrid else contextlib.nullcontext()), \
                (features.dsa.real_layer_numbers(reduced.numbers if reduced else pipeline.stage_layers(provider, stage))
                 if features.dsa.index_shared(provider) and not hybrid else contextlib.nullcontext()):
            model = build_rank_model(stage_provider, prepared.peft, attention=attention, mode=mode, device=device,
                                     dtype=prepared.dtype, transformer_impl=impl,
                                     mtp_moe=moe_layer_pattern(provider)[-1] == 1)
        traced = trace_microbatch(model, mode, seq=prepared.local_seq, micro_batch=prepared.micro_batch,
                                  hidden=provider.hidden_size, dtype=prepared.dtype, device=device,
                                  sequence_parallel_tp=tp if sp else 1)
        routed = max(load.routed_tokens, default=0)
        vocab_local = _output_weight(model).shape[0] if model.post_process else 0
        recomputed_layer = _recomputed_layer_bytes(provider, prepared, attention, impl, mode, device) \
            if provider.recompute_granularity == "full" else 0
    return model, traced, routed, vocab_local, recomputed_layer


def _te_checks_in_the_loss():
    """The loss's Transformer Engine version check (Core's ``LanguageModule.compute_language_model_loss`` asserts TE >=
    2.7.0 for the CUDA-graph capturable cross entropy of ``cuda_graph_impl="full_iteration"``,
    ``language_module.py`` L171-184) answered for the modelled release, as the config's other checks are
    (:func:`.te.version_checks_of_the_modelled_release`)."""
    from megatron.core.models.common.language_module import language_module

    return te.version_checks_of_the_modelled_release(language_module)


def _output_weight(model) -> torch.Tensor:
    """The weight the last stage's logits are computed with: the output layer's own, or with tied
    embeddings on a one-stage model (where Core allocates none for the output layer) the embedding's."""
    if model.output_layer.weight is not None:
        return model.output_layer.weight
    return model.shared_embedding_or_output_weight()


def _static(prepared: Prepared, counts: static.ParameterCounts, fp8_weights: Optional[precision.Fp8Weights] = None,
            fp8: Optional[precision.Fp8] = None) -> tuple[list[Component], phases.StepState]:
    """The static components of the rank and what its optimizer's step holds and allocates."""
    grad_bytes = static.grad_buffer_bytes(prepared.ddp, counts.element_size)
    rule = static.optimizer_rule(prepared.optimizer, param_bytes=counts.element_size,
                                 data_parallel=prepared.data_parallel,
                                 context_parallel=prepared.provider.context_parallel_size)
    ep, etp = expert_sizes(prepared.provider)
    expert_dp = static.expert_data_parallel(data_parallel=prepared.data_parallel,
                                            tensor_parallel=prepared.provider.tensor_model_parallel_size,
                                            context_parallel=prepared.provider.context_parallel_size,
                                            expert_parallel=ep, expert_tensor_parallel=etp)
    shard = static.optimizer_shard(counts, rule, expert_shards=expert_dp)
    step = phases.step_state(prepared.optimizer, shard, rule, grad_bytes=grad_bytes, ddp=prepared.ddp,
                             resume=prepared.resume)
    gather = muon.gather_transient(prepared.optimizer, counts.trainable_total - counts.trainable_experts,
                                   counts.trainable_experts, param_bytes=counts.element_size,
                                   dense_shards=rule.shards, expert_shards=expert_dp)
    if gather:
        step = dataclasses.replace(step, transients=step.transients + (gather,))
    if fp8_weights is None:
        return static.static_components(counts, grad_bytes=grad_bytes, rule=rule, expert_shards=expert_dp), step
    out = static.static_components(counts, grad_bytes=grad_bytes, rule=rule, expert_shards=expert_dp,
                                   stored_apart=precision.stored_apart(fp8_weights, fp8))
    return out + [c for c in [precision.component(fp8_weights, fp8)] if c], step


def _fsdp_static(prepared: Prepared, model, sources: Optional[list[int]],
                 param_bytes: int) -> tuple[list[Component], phases.StepState]:
    """Megatron-FSDP's lines of the rank (:mod:`.fsdp`) and its optimizer's step."""
    provider = prepared.provider
    ep, etp = expert_sizes(provider)
    dp = prepared.data_parallel * provider.context_parallel_size
    expert_dp = static.expert_data_parallel(data_parallel=prepared.data_parallel,
                                            tensor_parallel=provider.tensor_model_parallel_size,
                                            context_parallel=provider.context_parallel_size,
                                            expert_parallel=ep, expert_tensor_parallel=etp)
    lay = fsdp.layout(fsdp.buckets(model, prepared.ddp, dp=dp, expert_dp=expert_dp, sources=sources), prepared.ddp,
                      param_bytes=param_bytes)
    step = fsdp.step_state(prepared.optimizer, prepared.ddp, lay, param_bytes=param_bytes)
    return fsdp.static_components(lay, optimizer_states=step.masters + step.moments,
                                  optimizer_basis=fsdp.optimizer_basis(prepared.optimizer, prepared.ddp, lay,
                                                                       param_bytes=param_bytes)), step


def global_layer_numbers(provider, stage: int, model) -> list[int]:
    """The 0-based global number of each layer of ``stage``, in the order the stage is traced.

    A stage's model chunks are traced as one model, chunk v's layers after chunk v-1's, where Core numbers chunk
    v's layers from its own offset (:func:`.pipeline.stage_layers`, any split Core accepts). A hybrid model's
    stage (one chunk) holds its segment of the pattern (:func:`.unmodelled.pipeline_segments`), numbered from the
    layers of the stages before it (``hybrid_block.py`` L124-128), whatever layers a reduced stage traced.
    """
    if is_hybrid(provider):
        segments = unmodelled.pipeline_segments(provider)
        offset = sum(len(segment) for segment in segments[:stage])
        return list(range(offset, offset + len(segments[stage])))
    return pipeline.stage_layers(provider, stage)


def _fp8_layers(global_layers: list[int], fp8: Optional[precision.Fp8]):
    """Whether the traced layer of index ``local`` (None outside the layers) runs in FP8, by its global number."""
    return lambda local: fp8 is not None and local is not None and fp8.layer_in_fp8(global_layers[local])


def _moe_layer_indices(model, reduced: Optional[ReducedStage]) -> list[int]:
    """The indices of the stage's MoE layers, in the real stage's order (a reduced stage's by its sources)."""
    if reduced:
        return [i for i, source in enumerate(reduced.sources) if is_moe_kind(reduced.pattern[source])]
    return sorted({layer_of(name) for name in moe_layers_of(model)} - {None})


def _fp8_experts(model, fp8: precision.Fp8, routed: int, element: int,
                 fp8_layers: list[int]) -> Optional[fp8_experts.ExpertActivations]:
    """TE's contract for the routed experts of the stage's FP8 MoE layers (None: none, or frozen experts, whose
    grouped linears keep no input as the traced local ones keep none)."""
    experts = next((layer.mlp.experts.local_experts for layer in model.decoder.layers
                    if getattr(getattr(getattr(layer, "mlp", None), "experts", None), "local_experts", None)), None)
    if not fp8_layers or not experts or not routed:
        return None
    fc1, fc2 = (getattr(linear, "to_wrap", linear).weight for linear in (experts[0].linear_fc1, experts[0].linear_fc2))
    if not fc1.requires_grad:
        return None
    shapes = fp8_experts.ExpertShapes(experts=len(experts), hidden=fc1.shape[-1], ffn=fc2.shape[-1], routed=routed)
    return fp8_experts.contract(fp8.recipe, shapes, len(fp8_layers), element)


def _recomputes_layernorm(provider) -> bool:
    return provider.recompute_granularity == "selective" and "layernorm" in (provider.recompute_modules or [])


def _fp8_shapes(provider, prepared: Prepared, sp: bool) -> te_fp8.Shapes:
    tp = provider.tensor_model_parallel_size
    mamba_inner = mamba.shapes(provider).inner if is_hybrid(provider) and unmodelled.MAMBA in layer_kinds(provider) \
        else 0
    return te_fp8.Shapes(seq=prepared.local_seq, micro_batch=prepared.micro_batch, hidden=provider.hidden_size,
                         proj_in=provider.num_attention_heads * provider.kv_channels // tp,
                         ffn=provider.ffn_hidden_size // tp, tp=tp, sequence_parallel=sp, mamba_inner=mamba_inner)


def _graph_buffers(provider, prepared: Prepared, stage: int, in_flight: pipeline.InFlight, *, element: int,
                   sp: bool) -> Optional[Component]:
    """The static buffers of the config's captured CUDA graphs on ``stage`` (:mod:`.cuda_graphs`)."""
    tp, pp = provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size
    shapes = cuda_graphs.Shapes(tokens=prepared.local_seq // tp if sp else prepared.local_seq,
                                micro_batch=prepared.micro_batch, hidden=provider.hidden_size, element=element,
                                seq=prepared.seq, cp=provider.context_parallel_size or 1)
    vpp = len(in_flight.forwards)
    schedule = cuda_graphs.Schedule(pp=pp, vpp=vpp, stage=stage, num_microbatches=prepared.num_microbatches,
                                    group=getattr(provider, "microbatch_group_size_per_vp_stage", None) or pp,
                                    chunk_forwards=in_flight.forwards)
    return cuda_graphs.static_buffers(provider, impl=prepared.graph_impl, shapes=shapes,
                                      kinds=stage_layer_kinds(provider, stage), layer_chunks=in_flight.layer_chunks,
                                      schedule=schedule)


def _in_flight(provider, prepared: Prepared, stage: int, layers: int) -> pipeline.InFlight:
    """The forwards each model chunk of ``stage`` holds and the chunk of each of its ``layers`` traced layers (one
    chunk for a hybrid model, whose provider refuses interleaving)."""
    forwards = pipeline.chunk_forwards(pp=provider.pipeline_model_parallel_size,
                                       vpp=provider.virtual_pipeline_model_parallel_size,
                                       num_microbatches=prepared.num_microbatches, stage=stage,
                                       group_size=getattr(provider, "microbatch_group_size_per_vp_stage", None))
    if is_hybrid(provider):
        return pipeline.InFlight(tuple(forwards), (0,) * layers)
    chunks = pipeline.stage_chunks(provider)[stage]
    norm = pipeline.final_norm_chunk(provider, stage)
    return pipeline.InFlight(tuple(forwards), tuple(v for v, chunk in enumerate(chunks) for _ in chunk.layers),
                             norm_chunk=-1 if norm is None else norm, embedding_chunk=0 if stage == 0 else -1)


def _one_chunk_per_stage(stage_provider, provider) -> None:
    """Build ``stage_provider`` (a copy of ``provider``) with each stage's chunks as one chunk of the same layers
    (:func:`.pipeline.flatten`), its MoE and gated-delta-net layers where they are in the real split."""
    stages = pipeline.stage_chunks(provider)
    pipeline.flatten(stage_provider, [sum(len(chunk.layers) for chunk in chunks) for chunks in stages],
                     mtp=[sum(chunk.mtp for chunk in chunks) for chunks in stages])
    if getattr(provider, "num_moe_experts", None) or features.gated_delta_net.used(provider):
        kinds = layer_kinds(provider)
        set_gpt_layer_kinds(stage_provider, [kinds[layer] for chunks in stages for chunk in chunks
                                             for layer in chunk.layers])


def _activations(traced, in_flight: pipeline.InFlight, contract: te.TeContract,
                 fp8_acts: Optional[te_fp8.Fp8Activations] = None) -> list[Component]:
    """Each category's saves times the forwards in flight of the chunk that saved them; the contracts' per-layer
    corrections times the layers' mean."""
    out = []
    weighted = dict.fromkeys(CATEGORIES, 0.0)
    for (category, layer), nbytes in traced.by_category_and_layer.items():
        weighted[category] += nbytes * in_flight.weight(category, layer)
    for category in CATEGORIES:
        per = traced.by_category[category]
        shared = contract.shared_bytes if category == LORA_INPUTS else 0
        fp8_net = fp8_acts.net(category) if fp8_acts is not None else 0
        if per:
            basis = f"measured: {per:,} B saved for backward by one microbatch"
            if shared:
                basis += (f", less {shared:,} B: {contract.shared_copies} gathered copies that CanonicalLoRA's adapters "
                          "share under Transformer Engine (contract)")
            if fp8_net:
                basis += te_fp8.basis(fp8_acts, category)
            out.append(Component(ACTIVATIONS, category, round(weighted[category] + (fp8_net - shared) * in_flight.mean),
                                 f"{basis} x {in_flight.text()}"))
    return out


def _transients(provider, prepared: Prepared, *, element: int, vocab_local: int, sp: bool,
                recomputed_layer: int, routed: int = 0, dense_layers: bool = True,
                mamba_layers: bool = False, gdn_layers: bool = False) -> list[Component]:
    """The loss's logits and one layer's backward (``routed``: the tokens the local experts of an MoE layer
    received; ``dense_layers``: the stage has layers with a dense MLP; ``mamba_layers``: a hybrid model's Mamba
    layers, whose scan backward is :func:`..mamba.backward_bytes`; ``gdn_layers``: gated-delta-net layers, whose
    delta rule's backward is :func:`..features.gated_delta_net.backward_bytes`)."""
    s, b, h = prepared.local_seq, prepared.micro_batch, provider.hidden_size
    tp = provider.tensor_model_parallel_size
    out = []
    if vocab_local:
        out.append(Component(TRANSIENT, "logits at the loss", s * b * vocab_local * element,
                             f"formula: the [{s}, {b}, {vocab_local}] logits (or their gradient) in the training "
                             "dtype, next to the fp32 copy the loss keeps"))
    glu = 2 if provider.gated_linear_unit else 1
    candidates = []
    if dense_layers:
        ffn = provider.ffn_hidden_size // tp
        candidates.append((s * b * (glu * ffn + ffn + h) * element,
                           f"formula: MLP activation gradients in backward, [{s}, {b}, {glu * ffn}] + [{s}, {b}, {ffn}] + "
                           f"[{s}, {b}, {h}]{' (gathered before the reduce-scatter)' if sp else ''}"))
    if routed:
        _, etp = expert_sizes(provider)
        ffn = provider.moe_ffn_hidden_size // etp
        candidates.append((routed * (glu * ffn + ffn + h) * element,
                           f"formula: expert activation gradients in backward, [{routed}, {glu * ffn}] + "
                           f"[{routed}, {ffn}] + [{routed}, {h}]: the {routed:,} tokens routed to this rank's experts "
                           "(each of the EP x ETP ranks that send to them: its tokens x top-k x imbalance / EP), "
                           "as the dispatcher hands them over"))
    if mamba_layers:
        m = mamba.shapes(provider)
        states_dtype = getattr(provider, "mamba_training_ssm_states_dtype", None)
        state_element = static.dtype_bytes(states_dtype) if states_dtype is not None else element
        seq = s * (provider.context_parallel_size or 1)  # MambaContextParallel: the whole sequence, heads / CP
        candidates.append((mamba.backward_bytes(m, seq=seq, micro_batch=b, element=element, state_element=state_element),
                           f"formula: the Mamba scan's backward allocations (estimate.mamba.backward_bytes, from "
                           f"mamba_ssm's ssd_combined.py): gradients [{b}, {seq}, {m.in_proj}] + "
                           f"[{b}, {seq}, {m.inner}] + 2 x [{b}, {seq}, {m.conv}], and the chunk states' fp32 recompute and gradients "
                           f"({m.heads} heads x {m.head_dim} x {m.state} state per {m.chunk}-token chunk)"
                           f"{'' if getattr(provider, 'use_mamba_mem_eff_path', True) else mamba.UNFUSED_BACKWARD}"))
    if gdn_layers:
        candidates.append(_gdn_backward(provider, seq=s, micro_batch=b, element=element))
    exchange = features.context_parallel.transient(provider, local_seq=s, micro_batch=b, element=element)
    candidates += [exchange] if exchange else []
    mlp_grads, basis = max(candidates)
    if recomputed_layer:
        out.append(Component(TRANSIENT, "recomputed layer in backward", recomputed_layer + mlp_grads,
                             f"measured: {recomputed_layer:,} B one layer saves when recomputed (full recompute); "
                             f"+ {basis}"))
    else:
        out.append(Component(TRANSIENT, "layer backward", mlp_grads, basis))
    return out


def _gdn_backward(provider, *, seq: int, micro_batch: int, element: int) -> tuple[int, str]:
    heads = provider.linear_num_value_heads // provider.tensor_model_parallel_size
    return (features.gated_delta_net.backward_bytes(provider, seq=seq, micro_batch=micro_batch, element=element),
            f"formula: the gated delta rule's backward allocations (estimate.features.gated_delta_net.backward_bytes, "
            f"from fla's chunk.py): its recomputed chunk states and their gradient ({heads} heads x "
            f"{provider.linear_key_head_dim} x {provider.linear_value_head_dim} per 64-token chunk), and the query, "
            f"key, value and gate gradients of [{micro_batch}, {seq}, {heads}] heads")


def _recomputed_layer_bytes(provider, prepared: Prepared, attention: str, impl: str, mode, device: str) -> int:
    """What one layer saves when full recompute runs it again in backward: layer 0 of a one-layer-per-stage
    build without recompute (the first layer of a frozen-embedding PEFT model saves a little less than later
    ones; the difference is its LoRA-A input gradient path, not its saved inputs). With layers of several kinds
    (dense and MoE, a hybrid model's), the largest."""
    return max(_one_layer_bytes(provider, prepared, attention, impl, mode, device, kind)
               for kind in dict.fromkeys(layer_kinds(provider)))


def _one_layer_bytes(provider, prepared: Prepared, attention: str, impl: str, mode, device: str, kind) -> int:
    """What layer 0 of a one-layer-per-stage build of layers of ``kind`` (:func:`..build.layer_kinds`) saves,
    without recompute. Under DeepSeek sparse attention's shared top-k the layer is built as the model's first layer,
    which computes its own top-k (the larger: a layer reusing one keeps no indexer)."""
    one_layer = copy.deepcopy(provider)
    set_layer_kinds(one_layer, [kind])
    one_layer.num_layers_in_first_pipeline_stage = one_layer.num_layers_in_last_pipeline_stage = None
    one_layer.pipeline_model_parallel_layout = None
    one_layer.virtual_pipeline_model_parallel_size = None
    one_layer.recompute_granularity = one_layer.recompute_method = one_layer.recompute_num_layers = None
    one_layer.mtp_num_layers = None  # the layer alone; the last stage's MTP depths are traced with the stage
    with (features.dsa.real_layer_numbers([0]) if features.dsa.index_shared(provider) else contextlib.nullcontext()):
        model = build_rank_model(one_layer, prepared.peft, attention=attention, mode=mode, device=device,
                                 dtype=prepared.dtype, transformer_impl=impl)
    sp_tp = provider.tensor_model_parallel_size if provider.sequence_parallel else 1
    traced = trace_microbatch(model, mode, seq=prepared.local_seq, micro_batch=prepared.micro_batch,
                              hidden=provider.hidden_size, dtype=prepared.dtype, device=device,
                              sequence_parallel_tp=sp_tp)
    return traced.by_layer[0]


def _moe_settings(provider, *, imbalance: float, routed: int, moe_layers: int) -> Optional[MoeSettings]:
    """An MoE model's experts, their layout and the stated load; None for a dense model."""
    if not getattr(provider, "num_moe_experts", None):
        return None
    ep, etp = expert_sizes(provider)
    return MoeSettings(experts=provider.num_moe_experts, topk=provider.moe_router_topk,
                       ffn=provider.moe_ffn_hidden_size, ep=ep, etp=etp, local_experts=provider.num_moe_experts // ep,
                       dispatcher=provider.moe_token_dispatcher_type, imbalance=imbalance,
                       layers_on_stage=moe_layers, routed_tokens_per_layer=routed,
                       shared_ffn=getattr(provider, "moe_shared_expert_intermediate_size", None) or 0)


def _moe_assumptions(provider, imbalance: float, routed: int) -> list[str]:
    """How the MoE layers were traced: the stated load, the experts' implementation, the dispatcher."""
    if not getattr(provider, "num_moe_experts", None):
        return []
    load = ("balanced (1.0, the default): every expert receives tokens x top-k / experts" if imbalance == BALANCED
            else f"{imbalance:g} x the balanced share for each expert of the traced rank (the most loaded rank)")
    return [
        f"MoE routing: a stated load, not the router's choice: {load}; {routed:,} tokens reach this rank's experts "
        "per MoE layer per microbatch (estimate.routing; mbx plan --moe-imbalance sets it)",
        f"MoE experts: Megatron Core's SequentialMLP traced (the local spec's: one MLP per local expert, each "
        f"saving its own tokens' GEMM and activation inputs) with Core's {provider.moe_token_dispatcher_type} "
        "dispatcher; a grouped GEMM (TEGroupedMLP on Transformer Engine) keeps the same GEMM inputs concatenated, "
        "while its fused activation may keep a different set (not modelled); moe_act recompute as TEGroupedMLP "
        "applies it (estimate.features.moe_act)" + (
            "; with the experts' groups offloaded, run as TEGroupedMLP: Core's forward on the local experts' weights, "
            "fc1's input and the activation's inputs whole in one group each per layer "
            "(estimate.features.expert_offload)" if features.expert_offload.used(provider) else ""),
    ]


def _peft_settings(peft) -> Optional[PeftSettings]:
    if peft is None:
        return None
    from megatron_bridge_ext.levers.lora_input.config import strategy_in_effect
    from megatron_bridge_ext.peft import kinds

    return PeftSettings(name=f"{type(peft).__module__}.{type(peft).__name__}", kind=kinds.kind_of(peft),
                        lora_dim=getattr(peft, "dim", None),
                        lora_targets=tuple(getattr(peft, "target_modules", []) or []),
                        sequence_parallel_input_strategy=strategy_in_effect(peft))


def _settings(prepared: Prepared, *, attention: str, impl: str, device: str, stage: int, layers: int,
              moe: Optional[MoeSettings]) -> Settings:
    p = prepared.provider
    return Settings(
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        vpp=p.virtual_pipeline_model_parallel_size, cp=p.context_parallel_size, dp=prepared.data_parallel,
        sequence_parallel=bool(p.sequence_parallel) and p.tensor_model_parallel_size > 1,
        seq_length=prepared.seq, micro_batch=prepared.micro_batch, num_microbatches=prepared.num_microbatches,
        dtype=str(prepared.dtype).replace("torch.", ""), fp8=_fp8_text(p), stage=stage,
        layers_on_stage=layers,
        hidden=p.hidden_size, ffn=p.ffn_hidden_size, heads=p.num_attention_heads,
        query_groups=p.num_query_groups or p.num_attention_heads, kv_channels=p.kv_channels,
        num_layers=p.num_layers, gated_linear_unit=bool(p.gated_linear_unit), vocab_size=p.vocab_size,
        recompute_granularity=p.recompute_granularity, recompute_modules=tuple(p.recompute_modules or []),
        attention=attention, transformer_impl=impl, device=device,
        distributed_optimizer=bool(getattr(prepared.optimizer, "use_distributed_optimizer", False)),
        peft=_peft_settings(prepared.peft), hybrid=_hybrid_settings(p, stage), reports=prepared.reports, moe=moe,
        mla=_mla_settings(p), tp_comm_overlap=bool(getattr(p, "tp_comm_overlap", False)),
        fsdp=fsdp_rules.strategy(prepared.ddp) if fsdp_rules.enabled(prepared.ddp) else None,
        moment_bytes=_moment_bytes(prepared), optimizer_offload=offload.fraction(prepared.optimizer),
        optimizer_offload_overlap=bool(getattr(prepared.optimizer, "overlap_cpu_optimizer_d2h_h2d", False)))


def _moment_bytes(prepared: Prepared) -> int:
    """Bytes of both moments per element as the optimizer keeps them (:func:`.fsdp.moment_bytes` under
    Megatron-FSDP, else :func:`.static.optimizer_rule`'s)."""
    element = static.dtype_bytes(prepared.dtype)
    if fsdp_rules.enabled(prepared.ddp):
        return sum(fsdp.moment_bytes(prepared.optimizer, prepared.ddp, param_bytes=element))
    rule = static.optimizer_rule(prepared.optimizer, param_bytes=element, data_parallel=1, context_parallel=1)
    return sum(rule.moment_bytes)


def _mla_settings(provider) -> Optional[MlaSettings]:
    """A multi-latent attention model's latent ranks and head widths; None without it."""
    if not features.mla.used(provider):
        return None
    return MlaSettings(q_lora_rank=provider.q_lora_rank, kv_lora_rank=provider.kv_lora_rank,
                       qk_head_dim=provider.qk_head_dim, qk_pos_emb_head_dim=provider.qk_pos_emb_head_dim,
                       v_head_dim=provider.v_head_dim)


def _fp8_text(provider) -> Optional[str]:
    """The model's FP8 settings in words (format, recipe, parameters), or None without FP8: ``dtype`` alone is the
    16-bit type of the parameters and would hide that the linears run in FP8."""
    fp8 = precision.fp8_of(provider)
    return fp8.describe() if fp8 else None


def _hybrid_settings(provider, stage: int) -> Optional[HybridSettings]:
    """A hybrid model's layers on ``stage`` by kind (in the pattern's symbols' order) and its Mamba mixer's sizes
    (when it has Mamba layers); None for a GPT model."""
    pattern = unmodelled.hybrid_pattern(provider)
    if pattern is None:
        return None
    whole = mamba.shapes(provider, tp=1) if unmodelled.MAMBA in pattern else None  # the mixer's sizes before TP
    return HybridSettings(layers=unmodelled.layer_counts("".join(stage_layer_kinds(provider, stage))), mamba=whole)


def _assumptions(prepared: Prepared, attention: str, impl: str, device: str, contract: te.TeContract,
                 candidates: tuple = ()) -> list[str]:
    out = [
        "rank: TP rank 0 of the most loaded pipeline stage (TP ranks hold the same shapes); stages estimated: "
        f"{', '.join(map(str, candidates)) or '0'} (the first of each group of stages holding the same layers, "
        "embedding and loss under the config's pipeline split: a later one keeps no more microbatches in flight)",
        "activations traced on Megatron Core's local layer spec on fake "
        f"{'CUDA' if device == 'cuda' else 'CPU'} tensors (the {device} ops' saved tensors)",
        features.recipe_attention.assumption(prepared.provider, fused=attention == FUSED) or
        ("attention: a stand-in that keeps what fused (flash/cuDNN) attention keeps: q, k, v, output, fp32 "
         "log-sum-exp" if attention == FUSED else "attention: Megatron Core's unfused DotProductAttention "
                                                   "(keeps the [b, heads/t, s, s] probabilities)"),
        ("Transformer Engine: not traced; its fused norm-linear is modelled by its contract"
         + (f" ({contract.layers} norm-output shards added per microbatch)" if contract.layers else " (nothing to add here)")
         + (f" ({contract.shared_copies} gathered copies shared by CanonicalLoRA's adapters taken off)"
            if contract.shared_copies else "")
         if impl == TE else "Transformer Engine: not used (local spec)"),
        "jit-fused regions (torch.compile) traced eagerly",
        "optimizer moments: loaded from the checkpoint before iteration 1 (estimate.phases, resume)" if prepared.resume
        else "optimizer moments: created in the first step() (torch's Adam and TE's FusedAdam alike); iteration 1's "
             "phase holds the main copies without them (estimate.phases)",
        "transients: the largest of the listed formulas; not alive together",
        f"not modelled: {NOT_MODELLED}",
    ]
    if getattr(prepared.provider, "share_embeddings_and_output_weights", False):
        out.append("tied embeddings: one stage's output layer uses the embedding's weight (counted once); with PP > 1 "
                   "the last stage keeps its own copy, as Megatron Core does")
    if (prepared.provider.virtual_pipeline_model_parallel_size or 1) > 1:
        out.append("interleaved pipeline: a stage's model chunks traced as one model; what each chunk's layers save "
                   "counts once per forward of that chunk in flight (Core's schedule table), the embedding's with the "
                   "first chunk, the loss's with the last; layers whose build depends on their number are built by "
                   "their place in the stage")
    if is_hybrid(prepared.provider):
        out.append(mamba.ASSUMPTION)
    latent = features.dsa.assumption(prepared.provider) or features.mla.assumption(prepared.provider, impl)
    described = [latent, features.mtp.assumption(prepared.provider),
                 features.latent_moe.assumption(prepared.provider), features.token_dropping.assumption(prepared.provider),
                 features.context_parallel.assumption(prepared.provider),
                 features.flex.assumption(prepared.provider, static.dtype_bytes(prepared.dtype)),
                 features.hybridep.assumption(prepared.provider, tokens=_dispatched_tokens(prepared)),
                 features.paged_stash.assumption(prepared.provider)]
    kernels = features.kernel_notes(prepared.provider, unfused_attention=attention == LOCAL)
    return out + [text for text in described if text] + kernels + prepared.notes


def _dispatched_tokens(prepared: Prepared) -> int:
    """Tokens one rank's MoE layer dispatches per microbatch: its sequence shard under sequence parallelism."""
    provider = prepared.provider
    tp = provider.tensor_model_parallel_size
    split = tp if provider.sequence_parallel and tp > 1 else 1
    return prepared.local_seq * prepared.micro_batch // split
