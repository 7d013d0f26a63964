"""The recompute lever's flag, its checks and how it sets a Bridge model config.

``recompute_modules`` (selective activation recompute) names the modules Megatron Core recomputes
in backward; None leaves the model's recompute settings alone. Whether the checks on CPU offloading
and CUDA graphs pass depends on the recompute granularity this lever leaves: :meth:`granularity`
gives it to :mod:`megatron_bridge_ext.levers.parallelism`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.findings import ERROR, NO_EFFECT, WARNING, Finding
from megatron_bridge_ext.levers.change import Change
from megatron_bridge_ext.levers.recompute import attention
from megatron_bridge_ext.overrides import hydra_value

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "gdn_norm_out")
"""Megatron Core 0.17-0.19's accepted ``recompute_modules`` (TransformerConfig.__post_init__)."""
MOE_MODULES = ("moe", "moe_act", "shared_experts")


@dataclass(kw_only=True)
class RecomputeConfig:
    """``recompute_modules``: selective activation recompute modules (``["core_attn"]``, ...) or None."""

    recompute_modules: Optional[list[str]] = None

    def __post_init__(self) -> None:
        if self.recompute_modules is not None:
            self.recompute_modules = module_list(self.recompute_modules, "MemoryConfig.recompute_modules")

    def findings(self, model) -> list[Finding]:
        """The refusals and notes on the modules themselves, against the model they will recompute in."""
        out: list[Finding] = []
        modules = self.recompute_modules or []
        if "moe_act" in modules and not getattr(model, "moe_grouped_gemm", False):
            out.append(Finding("moe_act_grouped_gemm", ERROR, "recompute_modules", "'moe_act' needs grouped GEMM",
                               "set model.moe_grouped_gemm=True or drop 'moe_act'"))
        if "mla_up_proj" in modules and not getattr(model, "multi_latent_attention", False):
            out.append(Finding("mla_up_proj_needs_mla", ERROR, "recompute_modules",
                               "'mla_up_proj' needs multi-latent attention",
                               "drop 'mla_up_proj' (the model does not use MLA)"))
        if modules and getattr(model, "recompute_granularity", None) == "full":
            out.append(Finding(
                "replaces_full_recompute", ERROR, "recompute_modules",
                f"model.recompute_granularity is 'full' (recompute_method={getattr(model, 'recompute_method', None)!r}, "
                f"recompute_num_layers={getattr(model, 'recompute_num_layers', None)!r}); selective modules would "
                "replace full recompute, which keeps less activation memory, not more",
                "leave recompute_modules=None to keep full recompute, or switch to selective yourself first "
                "(model.recompute_granularity=None, model.recompute_method=None, model.recompute_num_layers=None)"))
        moe_only = [m for m in modules if m in MOE_MODULES]
        if moe_only and not getattr(model, "num_moe_experts", None):
            out.append(Finding("recompute_moe_on_dense", NO_EFFECT, "recompute_modules",
                               f"{moe_only} recompute MoE layers, and the model has none (num_moe_experts is unset)",
                               f"drop {moe_only}"))
        elif moe_only:
            out += _moe_findings(model, modules)
        return out

    def effect_findings(self, model) -> list[Finding]:
        """What ``core_attn`` recompute saves with the model's attention kernel (the memory effect in words)."""
        if "core_attn" not in (self.recompute_modules or []):
            return []
        kind = attention.attention_kind_from_config(model)
        level = WARNING if kind.materialises_scores else NO_EFFECT
        return [Finding("core_attn_effect", level, "recompute_modules", f"core_attn: {kind.core_attn_effect()}")]

    def granularity(self, model) -> Optional[str]:
        """The model's recompute granularity once this lever is applied."""
        return "selective" if self.recompute_modules else getattr(model, "recompute_granularity", None)

    def view(self, model):
        """The model's recompute fields as they will be after :meth:`apply` (the model itself when unchanged)."""
        if self.recompute_modules is None:
            return model
        merged = list(dict.fromkeys([*(getattr(model, "recompute_modules", None) or []), *self.recompute_modules]))
        return _RecomputeView("selective", merged)

    def apply(self, model) -> list[Change]:
        """Set the model's recompute fields (a "full" granularity was refused by :meth:`findings`)."""
        if self.recompute_modules is None:
            return []
        changes = []
        old_granularity = getattr(model, "recompute_granularity", None)
        old_modules = getattr(model, "recompute_modules", None)
        kept = ([m for m in (old_modules or []) if m not in self.recompute_modules]
                if old_granularity == "selective" else [])
        new_modules = kept + self.recompute_modules
        if old_granularity != "selective":
            model.recompute_granularity = "selective"
            changes.append(Change("model.recompute_granularity", old_granularity, "selective"))
        for name in ("recompute_method", "recompute_num_layers"):  # Megatron Core refuses them with selective
            old = getattr(model, name, None)
            if old is not None:
                setattr(model, name, None)
                changes.append(Change(f"model.{name}", old, None, "only used by full recompute"))
        if new_modules != old_modules:
            model.recompute_modules = new_modules
            changes.append(Change("model.recompute_modules", old_modules, new_modules,
                                  f"kept the model's {kept}" if kept else ""))
        return changes

    @staticmethod
    def overrides(changes: list[Change]) -> list[str]:
        """The Bridge overrides that make :meth:`apply`'s ``changes``: ``model.<field>=<value>`` each, the
        full-recompute fields it clears included."""
        return [f"{c.field}={hydra_value(c.new)}" for c in changes]


def _moe_findings(model, modules: list[str]) -> list[Finding]:
    """Megatron Core's refusals of the MoE modules on an MoE model (``TransformerConfig.__post_init__``, Core
    0.17-0.19), beyond ``moe_act``'s grouped GEMM, and ``shared_experts`` on a model without shared experts."""
    out = []
    shared = getattr(model, "moe_shared_expert_intermediate_size", None)
    if "shared_experts" in modules and not shared:
        out.append(Finding("recompute_no_shared_experts", NO_EFFECT, "recompute_modules",
                           "'shared_experts' recomputes the shared experts, and the model has none "
                           "(moe_shared_expert_intermediate_size is unset)", "drop 'shared_experts'"))
    if "shared_experts" in modules and shared and getattr(model, "moe_shared_expert_overlap", False):
        out.append(Finding("shared_experts_overlap", ERROR, "recompute_modules",
                           "'shared_experts' recompute cannot work with model.moe_shared_expert_overlap",
                           "drop 'shared_experts' or set model.moe_shared_expert_overlap=False"))
    if "moe" in modules and getattr(model, "overlap_moe_expert_parallel_comm", False):
        out.append(Finding("moe_recompute_ep_overlap", ERROR, "recompute_modules",
                           "'moe' recompute cannot work with model.overlap_moe_expert_parallel_comm",
                           "drop 'moe' or set model.overlap_moe_expert_parallel_comm=False"))
    offloaded = offloaded_inside_moe(modules, getattr(model, "offload_modules", None) or []) \
        if getattr(model, "fine_grained_activation_offloading", False) else []
    if offloaded:
        out.append(Finding("moe_recompute_offload", ERROR, "recompute_modules",
                           f"'moe' recompute checkpoints the whole MoE layer, and model.offload_modules offloads "
                           f"{offloaded} inside it", f"drop 'moe' or remove {offloaded} from model.offload_modules"))
    if "moe_act" in modules and getattr(model, "fp8", None) and getattr(model, "fp8_recipe", None) == "delayed":
        out.append(Finding("moe_act_fp8_delayed", ERROR, "recompute_modules",
                           "'moe_act' recompute is not supported with FP8 delayed scaling",
                           "drop 'moe_act' or use another model.fp8_recipe"))
    return out


def offloaded_inside_moe(modules, offload_modules) -> list[str]:
    """The offloaded modules Core refuses beside ``moe`` recompute, which checkpoints the whole MoE layer: the
    experts' offload groups (``moe_act``, ``expert_fc1``, ``fused_group_mlp``); none without ``moe`` in ``modules``."""
    if "moe" not in modules:
        return []
    return sorted({"moe_act", "expert_fc1", "fused_group_mlp"} & set(offload_modules))


def module_list(value, setting: str) -> list[str]:
    """``recompute_modules`` as a list of distinct names, or ValueError naming the problem and the fix."""
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
    unknown = [m for m in value if m not in RECOMPUTE_MODULES]
    if unknown:
        close = difflib.get_close_matches(unknown[0], RECOMPUTE_MODULES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{setting} names unknown module(s) {unknown}. Fix: {hint}choose from "
                         f"{list(RECOMPUTE_MODULES)}")
    duplicates = sorted({m for m in value if list(value).count(m) > 1})
    if duplicates:
        raise ValueError(f"{setting} names {duplicates} more than once. Fix: list each module once")
    return list(value)


@dataclass(frozen=True)
class _RecomputeView:
    """The recompute fields the model will have after :meth:`RecomputeConfig.apply`."""

    recompute_granularity: Optional[str]
    recompute_modules: list[str]
