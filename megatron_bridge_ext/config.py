"""``MemoryConfig``: the recipe flags of every memory feature, validated before launch and applied to a Bridge config.

Flow: ``MemoryConfig(...)`` (the flags) -> :meth:`MemoryConfig.validate` against the Bridge
``ConfigContainer`` it will be applied to (every error names the setting and the fix, before any
GPU time is spent) -> :meth:`MemoryConfig.apply`, which sets the Bridge config and returns a summary
of every field it changed, with old and new values. From a command line, :meth:`MemoryConfig.overrides`
gives the equivalent Bridge override set where one exists (Bridge's override parser cannot change a
PEFT object set in Python). ``validate`` also refuses a ``cfg.peft`` that Bridge's override parser
left a dict (a ``_target_`` it could not build, e.g. a misspelt strategy), with the class's own error.

``MemoryConfig`` composes the levers' own configs (:mod:`megatron_bridge_ext.levers`): each lever
owns its flags, checks, application and override strings; this module adds what concerns the PEFT
as a whole (its targets, the Transformer Engine norm-gradient fix) and joins the levers in order.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass, field
from typing import Optional

from megatron_bridge_ext.findings import ACTION, ERROR, NO_EFFECT, Finding, Refused
from megatron_bridge_ext.levers.allocator.config import AllocatorConfig
from megatron_bridge_ext.levers.change import Change
from megatron_bridge_ext.levers.lora_input.config import LoraInputConfig, is_lora_family
from megatron_bridge_ext.levers.activation_offload import constraints as activation_offload
from megatron_bridge_ext.levers.parallelism.constraints import model_findings
from megatron_bridge_ext.levers.recompute.config import RecomputeConfig
from megatron_bridge_ext.overrides import unbuilt_peft
from megatron_bridge_ext.peft import kinds

WHAT = "MemoryConfig"

@dataclass
class Summary:
    """What :meth:`MemoryConfig.apply` changed, and what validation found (warnings, no-effect notes)."""

    changes: list[Change] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def __str__(self) -> str:
        lines = ["MemoryConfig applied:"] + ([f"  {c}" for c in self.changes] or ["  (nothing changed)"])
        lines += [f"  {f}" for f in self.findings]
        return "\n".join(lines)


_RENAMED = ("MemoryConfig.lora_sp_input is deprecated: the flag is named sequence_parallel_input_strategy, as the "
            "field of the PEFT it sets. Fix: write MemoryConfig(sequence_parallel_input_strategy=...)")


def _accept_former_name(cls):
    """Let ``MemoryConfig(lora_sp_input=...)`` (the flag's former name) still build the config, with a
    DeprecationWarning; the dataclass itself has the one field, so repr, ``fields`` and ``replace`` see one name."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *, lora_sp_input: Optional[str] = None, **flags) -> None:
        if lora_sp_input is not None:
            warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
            given = flags.setdefault("sequence_parallel_input_strategy", lora_sp_input)
            if given != lora_sp_input:
                raise ValueError(f"MemoryConfig(lora_sp_input={lora_sp_input!r}, sequence_parallel_input_strategy="
                                 f"{given!r}) gives the one flag two values. Fix: write only "
                                 "sequence_parallel_input_strategy")
        init(self, **flags)

    cls.__init__ = __init__
    return cls


@_accept_former_name
@dataclass(kw_only=True)
class MemoryConfig:
    """The recipe flags of megatron-bridge-ext's memory features, one lever's config each.

    expandable_segments, allocator_ipc: :class:`~megatron_bridge_ext.levers.allocator.config.AllocatorConfig`.
    sequence_parallel_input_strategy: :class:`~megatron_bridge_ext.levers.lora_input.config.LoraInputConfig`
    (the same name as the field of our PEFT classes it sets).
    recompute_modules: :class:`~megatron_bridge_ext.levers.recompute.config.RecomputeConfig`.
    lora_sp_input: the former name of sequence_parallel_input_strategy, accepted with a DeprecationWarning.
    """

    expandable_segments: bool = True
    allocator_ipc: bool = False
    sequence_parallel_input_strategy: Optional[str] = None
    recompute_modules: Optional[list[str]] = None

    def __post_init__(self) -> None:
        # Each lever refuses a bad flag on construction (ValueError naming the flag and the fix).
        _ = self.allocator, self.lora_input
        self.recompute_modules = self.recompute.recompute_modules

    @property
    def lora_sp_input(self) -> Optional[str]:
        """The former name of ``sequence_parallel_input_strategy`` (deprecated)."""
        warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
        return self.sequence_parallel_input_strategy

    @lora_sp_input.setter
    def lora_sp_input(self, value: Optional[str]) -> None:
        warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
        self.sequence_parallel_input_strategy = value

    # The levers, read from the fields on each use: a field set after construction is seen.
    @property
    def allocator(self) -> AllocatorConfig:
        return AllocatorConfig(expandable_segments=self.expandable_segments, allocator_ipc=self.allocator_ipc)

    @property
    def lora_input(self) -> LoraInputConfig:
        return LoraInputConfig(sequence_parallel_input_strategy=self.sequence_parallel_input_strategy)

    @property
    def recompute(self) -> RecomputeConfig:
        return RecomputeConfig(recompute_modules=self.recompute_modules)

    # ------------------------------------------------------------------ validation
    def validate(self, cfg) -> list[Finding]:
        """Check the flags against ``cfg`` (a Bridge ConfigContainer); raise :class:`Refused` on errors, return the rest."""
        _check_container(cfg, "validate")
        unbuilt = unbuilt_peft(cfg)
        findings = [unbuilt] if unbuilt else []
        recompute = self.recompute
        findings += (recompute.findings(cfg.model) + model_findings(cfg.model, recompute.granularity(cfg.model))
                     + recompute.effect_findings(cfg.model) + activation_offload.findings(cfg.model)
                     + _target_findings(cfg)
                     + self.lora_input.findings(cfg, recompute.view(cfg.model)) + self.allocator.findings(cfg))
        errors = [f for f in findings if f.level == ERROR]
        if errors:
            raise Refused(WHAT, errors)
        return findings

    # ------------------------------------------------------------------ application
    def apply(self, cfg) -> Summary:
        """Validate, then set ``cfg`` (model recompute fields, peft, env_vars); return every change made."""
        _check_container(cfg, "apply")
        summary = Summary(findings=self.validate(cfg))
        summary.changes += self.recompute.apply(cfg.model) + self.lora_input.apply(cfg)
        summary.findings += _apply_te_gradient_fix(cfg)
        summary.changes += self.allocator.apply(cfg)
        return summary

    # ------------------------------------------------------------------ command line
    def overrides(self, cfg, *, peft_overrides: Optional[list[str]] = None) -> list[str]:
        """Bridge command-line overrides that make ``cfg`` what :meth:`apply` makes it, the allocator aside.

        Each lever gives the overrides of its own changes, joined in lever order:
        :meth:`RecomputeConfig.overrides <megatron_bridge_ext.levers.recompute.config.RecomputeConfig.overrides>`
        (``model.<field>=<value>``), then
        :meth:`LoraInputConfig.overrides <megatron_bridge_ext.levers.lora_input.config.LoraInputConfig.overrides>`
        (``cfg.peft``, reachable by overrides only where overrides built it on a ``cfg.peft`` of None:
        ``peft_overrides`` are the ones that built it beyond the user's own, ``mbx plan --peft``'s or [];
        with None, a PEFT object set in Python, it is left out and :meth:`peft_needs_python` says whether
        it changes). The allocator is not an override: launch with ``mbx run -- torchrun ...`` (or call
        ``megatron_bridge_ext.init()`` first), which sets it before CUDA starts.
        """
        recompute_changes, lora_input_changes = self._dry_run(cfg)
        return (self.recompute.overrides(recompute_changes)
                + self.lora_input.overrides(lora_input_changes, cfg, peft_overrides=peft_overrides))

    def peft_needs_python(self, cfg, *, peft_overrides: Optional[list[str]] = None) -> bool:
        """Whether :meth:`apply` changes ``cfg.peft`` in a way :meth:`overrides` cannot express."""
        return peft_overrides is None and bool(self._dry_run(cfg)[1])

    def _dry_run(self, cfg) -> tuple[list[Change], list[Change]]:
        """The recompute and LoRA-input changes :meth:`apply` would make to ``cfg``, made on a copy."""
        self.validate(cfg)
        copied = copy.deepcopy(cfg)
        return self.recompute.apply(copied.model), self.lora_input.apply(copied)


def _target_findings(cfg) -> list[Finding]:
    """LoRA targets that name no Megatron Core module: the adapter would be missing there, and Bridge
    says so only in a warning after the model is built."""
    peft = getattr(cfg, "peft", None)
    kind = kinds.kind_of(peft) if peft is not None else None
    if kind is None:
        return []
    bad = [kinds.field_problem(name, getattr(peft, name)) for name in kinds.CHECKED_FIELDS if hasattr(peft, name)]
    bad = [problem for problem in bad if problem]
    if bad:
        return [Finding("peft_field", ERROR, f"peft.{problem.split('=', 1)[0]}", problem.split('. Fix: ')[0],
                        problem.split('. Fix: ')[1]) for problem in bad]
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


def _apply_te_gradient_fix(cfg) -> list[Finding]:
    """A LoRA-family PEFT on Transformer Engine >= 2.4 needs the norm-gradient patch, whatever the flags say."""
    if cfg.peft is None or not is_lora_family(cfg.peft):
        return []
    from megatron_bridge_ext.patches import bridge_lora_te_norm_grad
    from megatron_bridge_ext.patches.base import APPLIED

    status, why = bridge_lora_te_norm_grad.PATCH.apply()
    if status != APPLIED:
        return []
    return [Finding(
        "te_norm_grad_patch", ACTION, "peft",
        f"patch bridge_lora_te_norm_grad applied in this process: {why}; the LoRA-A inputs it takes over "
        "(left on Bridge's gathered path) get the norm output as a shard plus an explicit all-gather, so "
        "their input gradient is not lost")]


def _check_container(cfg, method: str) -> None:
    """Refuse anything but a Bridge ConfigContainer, naming the argument: ``apply(cfg.model)`` would otherwise
    fail deep inside with an AttributeError that names neither the argument nor the fix."""
    if hasattr(cfg, "model") and hasattr(cfg, "peft"):
        return
    raise Refused(WHAT, [Finding(
        "not_a_config_container", ERROR, "cfg",
        f"{WHAT}.{method}(cfg) takes Bridge's ConfigContainer (the recipe's whole config), got a {type(cfg).__name__}",
        f"pass the container itself, {WHAT}(...).{method}(cfg), not cfg.model or cfg.peft")])
