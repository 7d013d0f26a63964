"""``MemoryConfig``: the recipe flags of every memory feature, validated before launch and applied to a Bridge config.

Flow: ``MemoryConfig(...)`` (the flags) -> :meth:`MemoryConfig.validate` against the Bridge
``ConfigContainer`` it will be applied to (every error names the setting and the fix, before any
GPU time is spent) -> :meth:`MemoryConfig.apply`, which sets the Bridge config and returns a summary
of every field it changed, with old and new values. From a command line, :meth:`MemoryConfig.overrides`
gives the equivalent Bridge override set where one exists (Bridge's override parser cannot change a
PEFT object set in Python). ``validate`` also refuses a ``cfg.peft`` that Bridge's override parser
left a dict (a ``_target_`` it could not build, e.g. a misspelt strategy), with the class's own error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from megatron_bridge_ext.levers.recompute import attention
from megatron_bridge_ext.findings import ACTION, ERROR, NO_EFFECT, WARNING, Finding, Refused
from megatron_bridge_ext.overrides import unbuilt_peft
from megatron_bridge_ext.levers.lora_input import sp_lora
from megatron_bridge_ext.peft import kinds
from megatron_bridge_ext.levers.lora_input.eligibility import ELIGIBLE_SURFACES, recompute_reason

WHAT = "MemoryConfig"


@dataclass(frozen=True)
class Change:
    field: str
    old: Any
    new: Any
    note: str = ""

    def __str__(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r}" + (f" ({self.note})" if self.note else "")


@dataclass
class Summary:
    """What :meth:`MemoryConfig.apply` changed, and what validation found (warnings, no-effect notes)."""

    changes: list[Change] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def __str__(self) -> str:
        lines = ["MemoryConfig applied:"] + ([f"  {c}" for c in self.changes] or ["  (nothing changed)"])
        lines += [f"  {f}" for f in self.findings]
        return "\n".join(lines)


@dataclass(kw_only=True)
class MemoryConfig:
    """The recipe flags of megatron-bridge-ext's memory features.

    expandable_segments: PyTorch's ``expandable_segments:True`` allocator option via ``cfg.env_vars``
        (set before CUDA starts, user options kept; see :mod:`megatron_bridge_ext.levers.allocator`).
    allocator_ipc: the processes share CUDA memory through IPC (colocated inference, weight sync):
        expandable segments are then left off.
    lora_sp_input: LoRA-A input under sequence parallelism: ``"regather"``, ``"shard_local"`` or
        ``"off"`` (see :mod:`megatron_bridge_ext.peft`) for a LoRA, DoRA or CanonicalLoRA ``cfg.peft``,
        which becomes our class of the same kind; None leaves ``cfg.peft`` alone.
    recompute_modules: selective activation recompute modules (``["core_attn"]``, ...); None leaves
        the model's recompute settings alone.
    """

    expandable_segments: bool = True
    allocator_ipc: bool = False
    lora_sp_input: Optional[str] = None
    recompute_modules: Optional[list[str]] = None

    def __post_init__(self) -> None:
        for name in ("expandable_segments", "allocator_ipc"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"MemoryConfig.{name}={value!r} is not a bool. Fix: write {name}=True or "
                                 f"{name}=False")
        sp_lora.check_choice(self.lora_sp_input, "MemoryConfig.lora_sp_input", allow_none=True)
        if self.recompute_modules is not None:
            self.recompute_modules = _module_list(self.recompute_modules)

    # ------------------------------------------------------------------ validation
    def validate(self, cfg) -> list[Finding]:
        """Check the flags against ``cfg`` (a Bridge ConfigContainer); raise :class:`Refused` on errors, return the rest."""
        _check_container(cfg, "validate")
        unbuilt = unbuilt_peft(cfg)
        findings = [unbuilt] if unbuilt else []
        findings += (self._recompute_findings(cfg.model) + self._target_findings(cfg) + self._lora_findings(cfg)
                     + self._allocator_findings(cfg))
        errors = [f for f in findings if f.level == ERROR]
        if errors:
            raise Refused(WHAT, errors)
        return findings

    def _recompute_findings(self, model) -> list[Finding]:
        out: list[Finding] = []
        modules = self.recompute_modules or []
        unknown = [m for m in modules if m not in attention.RECOMPUTE_MODULES]
        if unknown:
            out.append(Finding("unknown_recompute_module", ERROR, "recompute_modules", f"unknown module(s) {unknown}",
                               f"choose from {list(attention.RECOMPUTE_MODULES)}"))
        if "moe_act" in modules and not getattr(model, "moe_grouped_gemm", False):
            out.append(Finding("moe_act_grouped_gemm", ERROR, "recompute_modules", "'moe_act' needs grouped GEMM",
                               "set model.moe_grouped_gemm=True or drop 'moe_act'"))
        if "mla_up_proj" in modules and not getattr(model, "multi_latent_attention", False):
            out.append(Finding("mla_up_proj_needs_mla", ERROR, "recompute_modules",
                               "'mla_up_proj' needs multi-latent attention",
                               "drop 'mla_up_proj' (the model does not use MLA)"))
        current = getattr(model, "recompute_granularity", None)
        if modules and current == "full":
            out.append(Finding(
                "replaces_full_recompute", ERROR, "recompute_modules",
                f"model.recompute_granularity is 'full' (recompute_method={getattr(model, 'recompute_method', None)!r}, "
                f"recompute_num_layers={getattr(model, 'recompute_num_layers', None)!r}); selective modules would "
                "replace full recompute, which keeps less activation memory, not more",
                "leave recompute_modules=None to keep full recompute, or switch to selective yourself first "
                "(model.recompute_granularity=None, model.recompute_method=None, model.recompute_num_layers=None)"))
        moe_only = [m for m in modules if m in ("moe", "moe_act", "shared_experts")]
        if moe_only and not getattr(model, "num_moe_experts", None):
            out.append(Finding("recompute_moe_on_dense", NO_EFFECT, "recompute_modules",
                               f"{moe_only} recompute MoE layers, and the model has none (num_moe_experts is unset)",
                               f"drop {moe_only}"))
        granularity = "selective" if modules else current
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
        if "core_attn" in modules:
            kind = attention.attention_kind_from_config(model)
            level = WARNING if kind.materialises_scores else NO_EFFECT
            out.append(Finding("core_attn_effect", level, "recompute_modules", f"core_attn: {kind.core_attn_effect()}"))
        return out

    def _target_findings(self, cfg) -> list[Finding]:
        """LoRA targets that name no Megatron Core module: the adapter would be missing there, and Bridge
        says so only in a warning after the model is built."""
        peft = getattr(cfg, "peft", None)
        kind = kinds.kind_of(peft) if peft is not None else None
        if kind is None:
            return []
        targets = list(getattr(peft, "target_modules", None) or [])
        hf = {t: kinds.hf_target_fix(kind, t) for t in targets if kinds.hf_target_fix(kind, t)}
        unknown = [t for t in targets if t not in hf and not kinds.is_megatron_target(kind, t)]
        out = []
        if hf:
            suggested = list(dict.fromkeys(hf.values()))
            out.append(Finding(
                "lora_targets_hf_names", ERROR, "peft.target_modules",
                f"{list(hf)} are Hugging Face names and match no Megatron Core module, so no adapter would be added "
                "there", f"did you mean {suggested}? Write Megatron Core's names: "
                + ", ".join(f"{t} -> {n}" for t, n in hf.items())))
        if unknown:
            out.append(Finding(
                "lora_targets_unknown", NO_EFFECT, "peft.target_modules",
                f"{unknown} name no module of Megatron Core's layers, so they adapt nothing unless the model "
                "has a module of that name", "use Megatron Core's module names, e.g. "
                + str(kinds.target_names(kind, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]))))
        return out

    def _lora_findings(self, cfg) -> list[Finding]:
        if self.lora_sp_input is None:
            return []
        model = cfg.model
        if cfg.peft is None or not _is_lora_family(cfg.peft):
            return [Finding("lora_sp_input_needs_lora", ERROR, "lora_sp_input",
                            "needs a LoRA PEFT config (LoRA, DoRA or CanonicalLoRA), found "
                            f"{type(cfg.peft).__name__}",
                            "set cfg.peft to Bridge's or megatron_bridge_ext.peft's LoRA, DoRA or CanonicalLoRA, or "
                            "leave lora_sp_input=None")]
        if self.lora_sp_input == sp_lora.OFF:
            return []
        out = []
        if getattr(model, "tensor_model_parallel_size", 1) <= 1 or not getattr(model, "sequence_parallel", False):
            out.append(Finding("lora_sp_input_no_sp", NO_EFFECT, "lora_sp_input",
                               f"{self.lora_sp_input} has no effect with TP={model.tensor_model_parallel_size} "
                               f"and sequence_parallel={model.sequence_parallel}: there is no gathered input to avoid",
                               "enable model.sequence_parallel with TP > 1, or leave lora_sp_input=None"))
        out += self._lora_recompute_findings(cfg)
        return out

    def _lora_recompute_findings(self, cfg) -> list[Finding]:
        """The eligibility rule for adapters inside recomputed regions, on the model as it will be configured."""
        model = cfg.model
        if self.recompute_modules is not None:
            model = _RecomputeView(
                "selective",
                list(dict.fromkeys([*(getattr(model, "recompute_modules", None) or []), *self.recompute_modules])))
        targets = kinds.targeted_layers(getattr(cfg.peft, "target_modules", None) or ELIGIBLE_SURFACES)
        out = []
        for surface in ELIGIBLE_SURFACES:
            if surface not in targets:
                continue
            reason = recompute_reason(model, surface, self.lora_sp_input)
            if reason:
                out.append(Finding("lora_sp_input_recompute", WARNING, "lora_sp_input",
                                   f"{self.lora_sp_input} is not used for {surface}: {reason}",
                                   "use lora_sp_input='shard_local'"))
        return out

    def _allocator_findings(self, cfg) -> list[Finding]:
        if not self.expandable_segments:
            return []
        from megatron_bridge_ext.levers.allocator.apply import bridge_env_findings

        return bridge_env_findings(cfg, ipc=self.allocator_ipc)[1]

    # ------------------------------------------------------------------ application
    def apply(self, cfg) -> Summary:
        """Validate, then set ``cfg`` (model recompute fields, peft, env_vars); return every change made."""
        _check_container(cfg, "apply")
        summary = Summary(findings=self.validate(cfg))
        self._apply_recompute(cfg.model, summary)
        self._apply_lora(cfg, summary)
        self._apply_te_gradient_fix(cfg, summary)
        if self.expandable_segments:
            from megatron_bridge_ext.levers.allocator.apply import configure_bridge_env

            before = dict(getattr(cfg, "env_vars", None) or {})  # Bridge 0.5.1 has no env_vars field
            configure_bridge_env(cfg, ipc=self.allocator_ipc)
            for name, new in cfg.env_vars.items():
                if before.get(name) != new:
                    summary.changes.append(Change(f"env_vars.{name}", before.get(name), new))
        return summary

    def _apply_recompute(self, model, summary: Summary) -> None:
        if self.recompute_modules is None:
            return
        old_granularity = getattr(model, "recompute_granularity", None)  # "full" was refused by validate()
        old_modules = getattr(model, "recompute_modules", None)
        kept = ([m for m in (old_modules or []) if m not in self.recompute_modules]
                if old_granularity == "selective" else [])
        new_modules = kept + self.recompute_modules
        if old_granularity != "selective":
            model.recompute_granularity = "selective"
            summary.changes.append(Change("model.recompute_granularity", old_granularity, "selective"))
        for name in ("recompute_method", "recompute_num_layers"):  # Megatron Core refuses them with selective
            old = getattr(model, name, None)
            if old is not None:
                setattr(model, name, None)
                summary.changes.append(Change(f"model.{name}", old, None, "only used by full recompute"))
        if new_modules != old_modules:
            model.recompute_modules = new_modules
            note = f"kept the model's {kept}" if kept else ""
            summary.changes.append(Change("model.recompute_modules", old_modules, new_modules, note))

    def _apply_lora(self, cfg, summary: Summary) -> None:
        if self.lora_sp_input is None:
            return
        old = cfg.peft
        upstream_flag = bool(getattr(old, "sequence_parallel_input_regather", False))
        ours = kinds.our_class(kinds.kind_of(old))
        if not isinstance(old, ours):
            if self.lora_sp_input == sp_lora.OFF and not upstream_flag:
                return  # Bridge's class without the flag already takes the gathered input
            # Copies: the new object shares no mutable field (target lists, CanonicalLoRA's mapping) with the old.
            values = {f.name: copy.deepcopy(getattr(old, f.name))
                      for f in fields(old) if f.init and hasattr(old, f.name)}
            values.pop("sequence_parallel_input_regather", None)
            cfg.peft = ours(**values)
            summary.changes.append(Change("peft", type(old).__module__ + "." + type(old).__name__,
                                          f"megatron_bridge_ext.peft.{ours.__name__}",
                                          "every other field kept" if upstream_flag else "same fields"))
        previous = cfg.peft.strategy if isinstance(old, ours) else (sp_lora.REGATHER if upstream_flag else sp_lora.OFF)
        if upstream_flag:
            object.__setattr__(cfg.peft, "sequence_parallel_input_regather", False)
            summary.changes.append(Change("peft.sequence_parallel_input_regather", True, False,
                                          f"replaced by sequence_parallel_input_strategy={self.lora_sp_input!r}"))
        if cfg.peft.sequence_parallel_input_strategy != self.lora_sp_input:
            cfg.peft.sequence_parallel_input_strategy = self.lora_sp_input
            if previous != self.lora_sp_input:  # None -> "off" changes nothing a user would notice
                summary.changes.append(Change("peft.sequence_parallel_input_strategy", previous, self.lora_sp_input))

    def _apply_te_gradient_fix(self, cfg, summary: Summary) -> None:
        """A LoRA-family PEFT on Transformer Engine >= 2.4 needs the norm-gradient patch, whatever the flags say."""
        if cfg.peft is None or not _is_lora_family(cfg.peft):
            return
        from megatron_bridge_ext.patches import bridge_lora_te_norm_grad
        from megatron_bridge_ext.patches.base import APPLIED

        status, why = bridge_lora_te_norm_grad.PATCH.apply()
        if status == APPLIED:
            summary.findings.append(Finding(
                "te_norm_grad_patch", ACTION, "peft",
                f"patch bridge_lora_te_norm_grad applied in this process: {why}; the LoRA-A inputs it takes over "
                "(left on Bridge's gathered path) get the norm output as a shard plus an explicit all-gather, so "
                "their input gradient is not lost"))

    # ------------------------------------------------------------------ command line
    def overrides(self, cfg, *, peft_overrides: Optional[list[str]] = None) -> list[str]:
        """Bridge command-line overrides that make ``cfg`` what :meth:`apply` makes it, the allocator aside.

        Each model field :meth:`apply` would change becomes ``model.<field>=<value>`` (recompute
        fields, the full-recompute ones it clears included). ``cfg.peft`` is reachable by overrides
        only where overrides built it on a ``cfg.peft`` of None: ``peft_overrides`` are the ones that
        built it beyond the user's own (``mbx plan --peft``'s, or []), repeated first (``++`` sets or
        adds), then our class as ``_target_`` and the strategy where :meth:`apply` changes them. With
        ``peft_overrides`` None (a PEFT object set in Python) the PEFT is left out:
        :meth:`peft_needs_python` says whether it changes.
        The allocator is not an override: launch with ``mbx run -- torchrun ...`` (or call
        ``megatron_bridge_ext.init()`` first), which sets it before CUDA starts.
        """
        from megatron_bridge_ext.overrides import hydra_value

        changes = self._dry_run(cfg)
        out = [f"{c.field}={hydra_value(c.new)}" for c in changes if c.field.startswith("model.")]
        if peft_overrides is None:
            return out
        peft = {c.field: c.new for c in changes if c.field.split(".")[0] == "peft"}
        if "peft" in peft:  # the class changes: ours, named as a public target
            out.append(f"++peft._target_={kinds.public_target(kinds.kind_of(cfg.peft))}")
        out += [o for o in peft_overrides if not ("peft" in peft and o.startswith("++peft._target_="))]
        return out + [f"++{name}={hydra_value(new)}" for name, new in peft.items() if name != "peft"]

    def peft_needs_python(self, cfg, *, peft_overrides: Optional[list[str]] = None) -> bool:
        """Whether :meth:`apply` changes ``cfg.peft`` in a way :meth:`overrides` cannot express."""
        return peft_overrides is None and any(c.field.split(".")[0] == "peft" for c in self._dry_run(cfg))

    def _dry_run(self, cfg) -> list[Change]:
        """The model and PEFT changes :meth:`apply` would make to ``cfg``, made on a copy."""
        self.validate(cfg)
        copied = copy.deepcopy(cfg)
        summary = Summary()
        self._apply_recompute(copied.model, summary)
        self._apply_lora(copied, summary)
        return summary.changes


def _check_container(cfg, method: str) -> None:
    """Refuse anything but a Bridge ConfigContainer, naming the argument: ``apply(cfg.model)`` would otherwise
    fail deep inside with an AttributeError that names neither the argument nor the fix."""
    if hasattr(cfg, "model") and hasattr(cfg, "peft"):
        return
    raise Refused(WHAT, [Finding(
        "not_a_config_container", ERROR, "cfg",
        f"{WHAT}.{method}(cfg) takes Bridge's ConfigContainer (the recipe's whole config), got a {type(cfg).__name__}",
        f"pass the container itself, {WHAT}(...).{method}(cfg), not cfg.model or cfg.peft")])


def _module_list(value) -> list[str]:
    """``recompute_modules`` as a list of distinct names, or ValueError naming the problem and the fix."""
    setting = "MemoryConfig.recompute_modules"
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{setting}={value!r} is not a list of module names. Fix: write e.g. "
                         "recompute_modules=['core_attn']")
    bad = [m for m in value if not isinstance(m, str)]
    if bad:
        raise ValueError(f"{setting} holds non-string entries {bad!r}. Fix: list module names, e.g. ['core_attn']")
    if not value:
        raise ValueError(f"{setting}=[] asks for no module, and Megatron Core would recompute its default "
                         "['core_attn'] instead. Fix: name the modules, or leave recompute_modules=None to keep "
                         "the model's recompute settings")
    duplicates = sorted({m for m in value if list(value).count(m) > 1})
    if duplicates:
        raise ValueError(f"{setting} names {duplicates} more than once. Fix: list each module once")
    return list(value)


@dataclass(frozen=True)
class _RecomputeView:
    """The recompute fields the model will have after :meth:`MemoryConfig.apply`."""

    recompute_granularity: Optional[str]
    recompute_modules: list[str]


def _is_lora_family(peft) -> bool:
    """Bridge's LoRA, DoRA or CanonicalLoRA (ours derive from them)."""
    return kinds.kind_of(peft) is not None
