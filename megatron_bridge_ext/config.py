"""``MemoryConfig``: the recipe flags of every memory feature, validated before launch and applied to a Bridge config.

Flow: ``MemoryConfig(...)`` (the flags) -> :meth:`MemoryConfig.validate` against the Bridge
``ConfigContainer`` it will be applied to (every error names the setting and the fix, before any
GPU time is spent) -> :meth:`MemoryConfig.apply`, which sets the Bridge config and returns a summary
of every field it changed, with old and new values. From a command line, :meth:`MemoryConfig.overrides`
gives the equivalent Bridge override set.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from megatron_bridge_ext import recompute

LORA_SP_INPUT = ("off", "regather", "shard_local")
ERROR, WARNING, NO_EFFECT = "error", "warning", "no effect"


class MemoryConfigError(ValueError):
    """One or more flags cannot work with the Bridge config; the message lists each with its fix."""

    def __init__(self, findings: list["Finding"]):
        self.findings = findings
        super().__init__("MemoryConfig refused:\n" + "\n".join(f"  - {f}" for f in findings))


@dataclass(frozen=True)
class Finding:
    level: str
    setting: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"[{self.level}] {self.setting}: {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


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
        (set before CUDA starts, user options kept; see :mod:`megatron_bridge_ext.allocator`).
    allocator_ipc: the processes share CUDA memory through IPC (colocated inference, weight sync):
        expandable segments are then left off.
    lora_sp_input: LoRA-A input under sequence parallelism: ``off``, ``regather`` or ``shard_local``
        (see :mod:`megatron_bridge_ext.peft`).
    recompute_modules: selective activation recompute modules (``["core_attn"]``, ...); None leaves
        the model's recompute settings alone.
    """

    expandable_segments: bool = True
    allocator_ipc: bool = False
    lora_sp_input: str = "off"
    recompute_modules: Optional[list[str]] = None

    def __post_init__(self) -> None:
        if self.lora_sp_input not in LORA_SP_INPUT:
            raise ValueError(f"MemoryConfig.lora_sp_input={self.lora_sp_input!r} is not valid; use one of {LORA_SP_INPUT}")
        if self.recompute_modules is not None:
            self.recompute_modules = list(self.recompute_modules)

    # ------------------------------------------------------------------ validation
    def validate(self, cfg) -> list[Finding]:
        """Check the flags against ``cfg`` (a Bridge ConfigContainer); raise on errors, return the rest."""
        findings = self._recompute_findings(cfg.model) + self._lora_findings(cfg) + self._allocator_findings(cfg)
        errors = [f for f in findings if f.level == ERROR]
        if errors:
            raise MemoryConfigError(errors)
        return findings

    def _recompute_findings(self, model) -> list[Finding]:
        out: list[Finding] = []
        modules = self.recompute_modules or []
        unknown = [m for m in modules if m not in recompute.RECOMPUTE_MODULES]
        if unknown:
            out.append(Finding(ERROR, "recompute_modules", f"unknown module(s) {unknown}",
                               f"choose from {list(recompute.RECOMPUTE_MODULES)}"))
        if "moe_act" in modules and not getattr(model, "moe_grouped_gemm", False):
            out.append(Finding(ERROR, "recompute_modules", "'moe_act' needs grouped GEMM",
                               "set model.moe_grouped_gemm=True or drop 'moe_act'"))
        if "mla_up_proj" in modules and not getattr(model, "multi_latent_attention", False):
            out.append(Finding(ERROR, "recompute_modules", "'mla_up_proj' needs multi-latent attention",
                               "drop 'mla_up_proj' (the model does not use MLA)"))
        granularity = "selective" if modules else getattr(model, "recompute_granularity", None)
        if getattr(model, "cpu_offloading", False):
            if granularity is not None:
                out.append(Finding(ERROR, "model.cpu_offloading", "CPU offloading cannot be combined with activation recompute",
                                   "turn off model.cpu_offloading or the recompute flags"))
            if getattr(model, "pipeline_model_parallel_size", 1) > 1:
                out.append(Finding(ERROR, "model.cpu_offloading", "CPU offloading needs pipeline parallel size 1",
                                   "set model.pipeline_model_parallel_size=1 or turn off model.cpu_offloading"))
        graphs = getattr(model, "cuda_graph_impl", "none") or "none"
        if granularity == "full" and graphs not in ("none", "full_iteration"):
            out.append(Finding(ERROR, "model.recompute_granularity", f"full recompute with per-layer CUDA graphs ({graphs})",
                               "use cuda_graph_impl='full_iteration' or selective recompute"))
        if getattr(model, "distribute_saved_activations", False) and getattr(model, "sequence_parallel", False):
            out.append(Finding(ERROR, "model.distribute_saved_activations", "cannot be combined with sequence parallelism",
                               "set model.distribute_saved_activations=False"))
        if "core_attn" in modules:
            kind = recompute.attention_kind_from_config(model)
            level = WARNING if kind.materialises_scores else NO_EFFECT
            out.append(Finding(level, "recompute_modules", f"core_attn: {kind.core_attn_effect()}"))
        return out

    def _lora_findings(self, cfg) -> list[Finding]:
        if self.lora_sp_input == "off":
            return []
        model = cfg.model
        if cfg.peft is None or not _is_lora(cfg.peft):
            return [Finding(ERROR, "lora_sp_input", f"needs a LoRA PEFT config, found {type(cfg.peft).__name__}",
                            "set cfg.peft to megatron_bridge_ext.peft.LoRA(...) or Bridge's LoRA, or lora_sp_input='off'")]
        out = []
        if getattr(model, "tensor_model_parallel_size", 1) <= 1 or not getattr(model, "sequence_parallel", False):
            out.append(Finding(NO_EFFECT, "lora_sp_input",
                               f"{self.lora_sp_input} has no effect with TP={model.tensor_model_parallel_size} "
                               f"and sequence_parallel={model.sequence_parallel}: there is no gathered input to avoid",
                               "enable model.sequence_parallel with TP > 1, or leave lora_sp_input='off'"))
        if self.lora_sp_input == "regather":
            if getattr(model, "recompute_granularity", None) == "full" or (self.recompute_modules and "mlp" in self.recompute_modules):
                out.append(Finding(WARNING, "lora_sp_input", "regather is refused for adapters inside recomputed "
                                   "regions (full recompute, or linear_fc1 under 'mlp')", "use lora_sp_input='shard_local'"))
        return out

    def _allocator_findings(self, cfg) -> list[Finding]:
        if not self.expandable_segments:
            return []
        from megatron_bridge_ext import allocator

        try:
            result = allocator.plan_bridge_env(cfg, ipc=self.allocator_ipc)
        except allocator.AllocatorSetupError as exc:
            return [Finding(ERROR, f"allocator ({f.setting})", f.message, f.fix) for f in exc.findings]
        return [Finding(WARNING if f.level != "info" else NO_EFFECT, f"allocator ({f.setting})", f.message, f.fix)
                for f in result.findings if f.level in ("warning", "info")]

    # ------------------------------------------------------------------ application
    def apply(self, cfg) -> Summary:
        """Validate, then set ``cfg`` (model recompute fields, peft, env_vars); return every change made."""
        summary = Summary(findings=self.validate(cfg))
        self._apply_recompute(cfg.model, summary)
        self._apply_lora(cfg, summary)
        if self.expandable_segments:
            from megatron_bridge_ext import allocator

            before = dict(cfg.env_vars or {})
            allocator.configure_bridge_env(cfg, ipc=self.allocator_ipc)
            for name, new in cfg.env_vars.items():
                if before.get(name) != new:
                    summary.changes.append(Change(f"env_vars.{name}", before.get(name), new))
        return summary

    def _apply_recompute(self, model, summary: Summary) -> None:
        if self.recompute_modules is None:
            return
        old_granularity = getattr(model, "recompute_granularity", None)
        old_modules = list(getattr(model, "recompute_modules", None) or [])
        if old_granularity == "full":
            summary.findings.append(Finding(WARNING, "model.recompute_granularity",
                                            "was 'full'; replaced by selective recompute of the requested modules"))
        kept = [m for m in old_modules if m not in self.recompute_modules] if old_granularity == "selective" else []
        new_modules = kept + self.recompute_modules
        if old_granularity != "selective":
            model.recompute_granularity = "selective"
            summary.changes.append(Change("model.recompute_granularity", old_granularity, "selective"))
        if new_modules != old_modules:
            model.recompute_modules = new_modules
            note = f"kept the model's {kept}" if kept else ""
            summary.changes.append(Change("model.recompute_modules", old_modules, new_modules, note))

    def _apply_lora(self, cfg, summary: Summary) -> None:
        if self.lora_sp_input == "off":
            return
        from megatron_bridge_ext.peft import LoRA

        old = cfg.peft
        if not isinstance(old, LoRA):
            values = {f.name: getattr(old, f.name) for f in fields(old) if f.init and hasattr(old, f.name)}
            values.pop("sequence_parallel_input_regather", None)
            cfg.peft = LoRA(**values)
            summary.changes.append(Change("peft", type(old).__module__ + "." + type(old).__name__,
                                          "megatron_bridge_ext.peft.LoRA", "same fields"))
        previous = cfg.peft.sequence_parallel_input_strategy
        if previous != self.lora_sp_input:
            cfg.peft.sequence_parallel_input_strategy = self.lora_sp_input
            summary.changes.append(Change("peft.sequence_parallel_input_strategy", previous, self.lora_sp_input))

    # ------------------------------------------------------------------ command line
    def overrides(self) -> list[str]:
        """The Bridge command-line overrides for the model and PEFT flags.

        cfg.peft must be None for the ``+peft`` pair (Bridge 0.6.2 keeps an existing PEFT object out of
        overrides). The allocator is not an override: launch with ``mbx run -- torchrun ...`` (or call
        ``megatron_bridge_ext.init()`` first), which sets it before CUDA starts.
        """
        out = []
        if self.recompute_modules is not None:
            out += ["model.recompute_granularity=selective",
                    "model.recompute_modules=[" + ",".join(self.recompute_modules) + "]"]
        if self.lora_sp_input != "off":
            out += ["+peft._target_=megatron_bridge_ext.peft.LoRA",
                    f"+peft.sequence_parallel_input_strategy={self.lora_sp_input}"]
        return out


def _is_lora(peft) -> bool:
    from megatron.bridge.peft.lora import LoRA as BridgeLoRA

    return isinstance(peft, BridgeLoRA)
