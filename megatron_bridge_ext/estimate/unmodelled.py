"""What our estimate leaves out of a config, each part named with the setting that brings it in.

Some things a config can switch on are outside every figure here, and a plan that stays silent on
them would read as if they were counted:

* of a hybrid model (Nemotron-H, Nemotron 3 Nano: Bridge's ``HybridModelProvider``,
  ``hybrid_layer_pattern``), the layer kinds other than Mamba, attention, MLP and MoE: our estimate
  refuses those by name (:func:`hybrid_findings`); its Mamba layers are traced with stand-ins for
  the ``mamba_ssm`` kernels (:mod:`.mamba`), each pipeline stage with its segment of the pattern
  (:func:`pipeline_segments`). Bridge's formula reads no layer
  pattern and has no Mamba term: it counts every layer as attention plus MLP or MoE (:func:`bridge_caveat`);
* CUDA graphs (``cuda_graph_impl``, or the deprecated ``enable_cuda_graph`` /
  ``external_cuda_graph`` that Core's ``TransformerConfig.__post_init__`` turns into it): the
  graphs allocate from a private pool (static inputs, outputs and the intermediates of the captured
  regions); our estimate counts the static buffers the graphs hold in its capture phase
  (:mod:`.cuda_graphs`), and the intermediates as the traced activations; the pool's reserved but free
  memory is in no figure, nor is any of it in Bridge's (:func:`cuda_graph_line`).
"""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding

MAMBA, MLP, MOE = "M", "-", "E"
LAYER_NAMES = {"M": "Mamba", "G": "gated delta net", "*": "attention", "D": "DeepSeek sparse attention",
               "+": "multi-latent attention", "-": "MLP", "E": "MoE"}
"""The layer symbols of Megatron Core's hybrid pattern (``models/hybrid/hybrid_layer_allocation.py``, ``Symbols``)."""
PIPE, MTP_SEPARATOR = "|", "/"


def hybrid_pattern(model) -> Optional[str]:
    """The main decoder's layer pattern of a hybrid model (pipeline marks and MTP layers left out), or None.

    Bridge's provider takes the deprecated ``hybrid_override_pattern`` as ``hybrid_layer_pattern`` in
    ``finalize``; before that either field may hold it.
    """
    main = main_pattern(model)
    return None if main is None else main.replace(PIPE, "")


def main_pattern(model) -> Optional[str]:
    """The main decoder's layer pattern of a hybrid model as given, pipeline marks kept (MTP layers left out), or
    None."""
    pattern = getattr(model, "hybrid_layer_pattern", None) or getattr(model, "hybrid_override_pattern", None)
    return pattern.split(MTP_SEPARATOR, 1)[0] if pattern else None


def pipeline_segments(model) -> Optional[list[str]]:
    """Each pipeline stage's layer pattern of a hybrid model, as Megatron Core's ``select_pipeline_segment``
    (``models/hybrid/hybrid_layer_allocation.py``) gives the stages their layers: the main pattern split at its
    ``|`` marks, or without marks an even split over the pipeline stages (uneven with
    ``num_layers_in_first_pipeline_stage`` / ``..._last_...``); None for any other model."""
    main = main_pattern(model)
    if main is None:
        return None
    if PIPE in main:
        return main.split(PIPE)
    pp = getattr(model, "pipeline_model_parallel_size", 1) or 1
    if pp == 1:
        return [main]
    first = getattr(model, "num_layers_in_first_pipeline_stage", None)
    last = getattr(model, "num_layers_in_last_pipeline_stage", None)
    middle = pp - (first is not None) - (last is not None)
    rest = len(main) - (first or 0) - (last or 0)
    per = rest // middle if middle > 0 else 0
    sizes = ([first] if first is not None else []) + [per] * middle + ([last] if last is not None else [])
    out, start = [], 0
    for size in sizes:
        out.append(main[start:start + size])
        start += size
    return out


def layer_counts(pattern: str) -> dict[str, int]:
    """How many layers of each kind the pattern has, by name, in the order of :data:`LAYER_NAMES`."""
    return {name: pattern.count(symbol) for symbol, name in LAYER_NAMES.items() if pattern.count(symbol)}


MODELLED = frozenset("M*-E")
"""The hybrid layers the estimate builds and traces: Mamba (kernels by stand-in, :mod:`.mamba`), attention, MLP, MoE."""


def hybrid_findings(model) -> list[Finding]:
    """What of a hybrid model the estimate does not model, each by name: layer kinds other than Mamba, attention,
    MLP and MoE, and virtual pipelines (which Bridge's provider refuses). The mixer's unfused path is traced
    (:mod:`.mamba_unfused`); FP8 on Mamba layers is modelled (:mod:`.te_fp8`: ``in_proj`` and ``out_proj`` are TE
    linears); FP4 is refused for every model. Empty for a hybrid model the estimate traces and for any other model."""
    pattern = hybrid_pattern(model)
    if pattern is None:
        return []
    out = []
    counts = layer_counts(pattern)
    others = {LAYER_NAMES[symbol]: counts[LAYER_NAMES[symbol]] for symbol in LAYER_NAMES
              if symbol not in MODELLED and symbol in pattern}
    if others:
        named = ", ".join(f"{n} {name}" for name, n in others.items())
        out.append(Finding("unsupported_model", ERROR, "model.hybrid_layer_pattern",
                           f"the hybrid model's {named} layer(s) (of {len(pattern)}) are not modelled by our estimate "
                           "(it traces Mamba, attention, MLP and MoE layers)",
                           "read Bridge's figure beside it, or measure one training step on a GPU"))
    if (getattr(model, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
        out.append(Finding("unsupported_model", ERROR, "model.virtual_pipeline_model_parallel_size",
                           "is set on a hybrid model: Bridge's HybridModelProvider refuses virtual pipelines "
                           "(provide() asserts it is None)", "unset it (one model chunk per pipeline stage)"))
    return out


def bridge_caveat(model) -> Optional[str]:
    """Why Bridge's figure is not this model's, for a hybrid model; None for any other model."""
    pattern = hybrid_pattern(model)
    if pattern is None:
        return None
    ffn = "MoE" if getattr(model, "num_moe_experts", None) else "MLP"
    counts = ", ".join(f"{n} {name}" for name, n in layer_counts(pattern).items())
    return (f"Bridge's formula reads no hybrid pattern: it counts all {len(pattern)} layers as attention + {ffn} "
            f"layers, where this model has {counts}")


def cuda_graph_setting(model) -> Optional[str]:
    """The setting that turns CUDA graphs on, as ``field=value`` with the captured modules, or None."""
    impl = getattr(model, "cuda_graph_impl", None) or "none"
    if impl == "none":
        for field, meant in (("enable_cuda_graph", "local"), ("external_cuda_graph", "transformer_engine")):
            if getattr(model, field, False):
                return f"model.{field}=True (cuda_graph_impl {meant!r})"
        return None
    modules = _module_names(getattr(model, "cuda_graph_modules", None))
    return f"model.cuda_graph_impl={impl!r}" + (f", modules {modules}" if modules else "")


def _module_names(modules) -> list[str]:
    if modules is None:
        return []
    items = modules if isinstance(modules, (list, tuple)) else [modules]
    return [m.name if isinstance(getattr(m, "name", None), str) else str(m) for m in items]


def cuda_graph_line(model) -> Optional[str]:
    """One line saying what of the CUDA graph memory pools is modelled when the config captures graphs, else None."""
    setting = cuda_graph_setting(model)
    if setting is None:
        return None
    return (f"CUDA graph memory pools ({setting}) are partly modelled: our capture phase counts the static buffers "
            "the graphs hold, and their intermediates as the traced activations; the pool's reserved but "
            "free memory is in no figure here (ours or Bridge's): leave headroom for it")


def cuda_graph_problem(model) -> Optional[Finding]:
    """CUDA graphs without Transformer Engine's RNG tracker, which Bridge's providers refuse in ``provide()``."""
    setting = cuda_graph_setting(model)
    if setting is None or getattr(model, "use_te_rng_tracker", False):
        return None
    return Finding("model_config", ERROR, "model.use_te_rng_tracker",
                   f"is off with CUDA graphs on ({setting}): Bridge's provider refuses to build the model "
                   "(Transformer Engine's RNG tracker is required for CUDA graphs)",
                   "set model.use_te_rng_tracker=True (and rng.te_rng_tracker=True), or turn CUDA graphs off")


def drop_cuda_graphs(model) -> list[str]:
    """Turn CUDA graphs off on the copy that is traced (capture needs a GPU and Core's graph manager a real RNG
    tracker); say so. Eager tracing keeps what the captured layers save for backward; the pools are named apart."""
    setting = cuda_graph_setting(model)
    if setting is None:
        return []
    model.cuda_graph_impl = "none"
    model.enable_cuda_graph = model.external_cuda_graph = False
    return [f"CUDA graphs ({setting}) traced eagerly: the layers save what they save uncaptured; the graphs' "
            "static buffers are the capture phase's (estimate.cuda_graphs)"]


def config_lines(cfg) -> list[str]:
    """What the plan says the estimates leave out of a Bridge config (beyond the margin's list): CUDA graph
    pools, and the activations of FP8 layers under blockwise scaling
    (:func:`megatron_bridge_ext.estimate.precision.activation_note`)."""
    from megatron_bridge_ext.estimate import precision

    fp8 = precision.fp8_of_config(cfg)
    lines = [cuda_graph_line(cfg.model), precision.activation_note(fp8) if fp8 else None]
    return [line for line in lines if line]
