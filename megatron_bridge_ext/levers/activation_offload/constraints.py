"""What Megatron Core 0.19 (``transformer/transformer_config.py`` ``__post_init__``, "config.py" below) and Bridge 0.6
refuse of fine-grained activation offloading, one finding each, checked before a model is built.

Pipeline parallelism, with or without virtual stages, is allowed: the offload manager keeps one handler per model
chunk and flushes them in the schedule's order (``pipeline_parallel/fine_grained_activation_offload.py`` L537-550,
L686-746). The refusal of offloading inside a recomputed MoE layer (config.py L1874-1884) lives with the recompute
lever (:func:`megatron_bridge_ext.levers.recompute.config.RecomputeConfig.findings`).
"""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding

SETTING = "model.offload_modules"
MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act", "fused_group_mlp")
"""The ``offload_modules`` Core accepts (config.py L1853-1867)."""


def findings(model) -> list[Finding]:
    """Core's and Bridge's refusals of the offload settings of ``model``; empty with the offload off."""
    if not getattr(model, "fine_grained_activation_offloading", False):
        return []
    modules = list(getattr(model, "offload_modules", None) or [])
    return _with_other_settings(model) + _modules(model, modules) + _values(model) + _graphs(model, modules)


def _refuse(setting: str, message: str, fix: str) -> Finding:
    return Finding("activation_offload", ERROR, setting, message, fix)


def _with_other_settings(model) -> list[Finding]:
    out = []
    if getattr(model, "cpu_offloading", False):
        out.append(_refuse("model.cpu_offloading", "cannot be combined with fine-grained activation offloading "
                           "(Core config.py L1849-1851)", "turn one of the two off"))
    impl = getattr(model, "transformer_impl", "transformer_engine")
    if impl != "transformer_engine":
        out.append(_refuse("model.transformer_impl", f"is {impl!r}: Bridge offloads activations only with "
                           "transformer_engine (training/config.py L2047-2051)", "set transformer_impl="
                           "'transformer_engine' or turn the offload off"))
    return out


def _modules(model, modules: list[str]) -> list[Finding]:
    if not modules:
        return [_refuse(SETTING, "is empty with fine_grained_activation_offloading on (Core config.py L1852)",
                        f"name modules from {', '.join(MODULES)}")]
    out = []
    unknown = sorted(set(modules) - set(MODULES))
    if unknown:
        out.append(_refuse(SETTING, f"{unknown} are not modules Core offloads (config.py L1853-1867)",
                           f"choose from {', '.join(MODULES)}"))
    if "attn_proj" in modules and "core_attn" not in modules:
        out.append(_refuse(SETTING, "attn_proj without core_attn: its input is core_attn's output, which core_attn's "
                           "backward needs (Core config.py L1868-1873)", "add core_attn or drop attn_proj"))
    if "fused_group_mlp" in modules:
        if not getattr(model, "use_transformer_engine_op_fuser", False):
            out.append(_refuse(SETTING, "fused_group_mlp needs model.use_transformer_engine_op_fuser (Core config.py "
                               "L1895-1897)", "set use_transformer_engine_op_fuser=True or drop fused_group_mlp"))
        partial = sorted({"expert_fc1", "moe_act"} & set(modules))
        if partial:
            out.append(_refuse(SETTING, f"fused_group_mlp already offloads the whole grouped MLP, with {partial} "
                               "(Core config.py L1898-1903)", f"drop {partial} or fused_group_mlp"))
    experts = sorted({"expert_fc1", "moe_act", "fused_group_mlp"} & set(modules))
    if experts and getattr(model, "moe_paged_stash", False):
        out.append(_refuse(SETTING, f"{experts} with moe_paged_stash: the paged stash covers the experts' activations "
                           "(Core config.py L1911-1920)", f"drop {experts} or moe_paged_stash"))
    return out


def _values(model) -> list[Finding]:
    out = []
    fraction = getattr(model, "activation_offload_fraction", 1.0)
    if not 0 <= fraction <= 1:
        out.append(_refuse("model.activation_offload_fraction", f"{fraction} is not in [0, 1] (Core config.py "
                           "L1888-1890)", "give a fraction of the offload groups from 0 to 1"))
    for name in ("min_offloaded_tensor_size", "delta_offload_bytes_across_pp_ranks"):
        if getattr(model, name, 0) < 0:
            out.append(_refuse(f"model.{name}", "is negative (Core config.py L1885-1893)", "give 0 or more"))
    return out


def _graphs(model, modules: list[str]) -> list[Finding]:
    """An offloaded module inside a per-layer CUDA graph needs warmup steps (``transformer_layer.py`` L1494-1512)."""
    captured = {getattr(m, "name", m) for m in (_as_list(getattr(model, "cuda_graph_modules", None)))}
    dense = not getattr(model, "num_moe_experts", None)  # Core checks mlp_norm in the dense layers' MLP graph only
    inside = ("attn" in captured and {"core_attn", "attn_proj", "qkv_linear"} & set(modules)) or \
        (dense and "mlp" in captured and "mlp_norm" in modules)
    if inside and not getattr(model, "cuda_graph_warmup_steps", 0):
        return [_refuse("model.cuda_graph_warmup_steps", "is 0 with an offloaded module inside a captured CUDA graph "
                        "(Core transformer_layer.py L1494-1512)", "set cuda_graph_warmup_steps to 1 or more")]
    return []


def _as_list(value) -> list:
    if value is None or isinstance(value, str):
        return [value] if value else []
    return list(value) if isinstance(value, (list, tuple)) else [value]
