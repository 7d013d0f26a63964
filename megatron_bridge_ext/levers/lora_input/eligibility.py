"""Which LoRA adapters may keep their LoRA-A input sequence-sharded, and why not.

At least upstream's rules (Bridge 0.6 ``sequence_parallel_input_regather``) apply to both
strategies: a column-parallel target (``linear_qkv``, ``linear_fc1``), TP > 1, sequence parallelism
on, a base linear that gathers its input over the sequence (not one whose communication Megatron
switched off, as for overlapped shared experts), trainable LoRA-A, identity activation, no expert
or all-to-all adapter, no CUDA graphs, no CPU activation offloading. Recompute differs by strategy:

* ``regather`` is refused under full recompute, and for a ``linear_fc1`` inside a selectively
  recomputed module: a dense layer's under ``mlp``, a shared expert's under ``shared_experts`` or
  ``moe`` (Core recomputes ``mlp`` in dense layers only). The recomputed region already drops the
  gathered input, and regather would only add an all-gather per recompute.
* ``shard_local`` stays correct there and is allowed: inside a recomputed region it still replaces
  the s*b*h all-gather of the input (and the s*b*h reduce-scatter of its grad) with all-gathers of
  the r x h weight, and it shrinks the gathered tensor that lives during the recomputed backward
  from s*b*h to the shard.

On an MoE model the eligible adapters are linear_qkv, a dense layer's linear_fc1 and a shared expert's
linear_fc1 (Core's shared-expert MLP is a column-parallel linear that gathers its sequence-sharded
input, unless ``moe_shared_expert_overlap`` hands that gather to the token dispatcher and switches
the linear's own off). A routed expert's linear_fc1 takes the tokens the dispatcher sent it.

The rules are the same for every LoRA-family kind. The adapters of one base layer (CanonicalLoRA's
q/k/v on ``linear_qkv``, up/gate on ``linear_fc1``) all take that layer's input, so they take it
the same way: all keep the shard (one storage, shared) or none does. A kind may add a reason of
its own (DoRA: see :mod:`megatron_bridge_ext.peft.dora`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.levers.lora_input.sp_lora import OFF, STRATEGIES

ELIGIBLE_SURFACES = ("linear_qkv", "linear_fc1")
EXPERT_INPUT = "a routed expert's input comes through the token dispatcher, not a sequence-parallel gather"
SHARED_EXPERT_RECOMPUTE = ("shared_experts", "moe")
"""Selective recompute modules whose checkpoint holds a shared expert's MLP (Core's moe_layer.py:244-253)."""


def is_shared_expert(layer_name: str) -> bool:
    """A layer of an MoE layer's shared-expert MLP (Core's ``SharedExpertMLP``, module ``...mlp.shared_experts``)."""
    return ".shared_experts." in f".{layer_name}."


@dataclass(frozen=True)
class Decision:
    """The verdict for one adapter: ``strategy`` is ``"off"`` when it takes the input as Bridge gives it.

    ``adapter`` names the adapted layer (with the adapter's key, ``...linear_qkv.adapter_q``, where a
    layer has several adapters); ``retains`` says what LoRA-A keeps for backward under that decision;
    ``lora_a`` is LoRA-A's module path.
    """

    adapter: str
    requested: str
    strategy: str
    reason: str
    retains: str = ""
    lora_a: str = ""

    @property
    def eligible(self) -> bool:
        return self.strategy != OFF

    def describe(self) -> str:
        """``adapter: strategy (reason); retains ...``: the one wording of a verdict, for logs and reports."""
        return f"{self.adapter}: {self.strategy} ({self.reason}); retains {self.retains}"


def _tp_size(adapter) -> int:
    group = getattr(adapter, "tp_group", None)
    if group is not None:
        return group.size()
    return int(getattr(adapter.config, "tensor_model_parallel_size", 1) or 1)


def _base_skips_sequence_parallel_comm(base) -> bool:
    """True when the base linear receives no sequence shard to gather (so neither does LoRA-A).

    Megatron switches the communication of a base linear off with ``parallel_mode=None`` (TE) or
    ``explicit_expert_comm=True`` (Megatron Core's own linears, e.g. shared experts with
    ``moe_shared_expert_overlap``); the input then arrives already complete.
    """
    return (
        not getattr(base, "sequence_parallel", True)
        or getattr(base, "parallel_mode", "") is None
        or bool(getattr(base, "explicit_expert_comm", False))
    )


def _fc1_recompute_module(config, shared_expert: Optional[bool]) -> Optional[str]:
    """The selective recompute module whose checkpoint holds a linear_fc1, or None.

    A dense layer's MLP is recomputed under ``mlp`` (Core sets ``recompute_mlp`` for dense layers only,
    transformer_layer.py:514-516), a shared expert under ``shared_experts`` or with its MoE layer under ``moe``.
    ``shared_expert`` None (before the model exists): either kind of linear_fc1, shared ones where the config
    has shared experts.
    """
    modules = getattr(config, "recompute_modules", None) or []
    candidates = [] if shared_expert else ["mlp"]
    if shared_expert or (shared_expert is None and getattr(config, "moe_shared_expert_intermediate_size", None)):
        candidates += SHARED_EXPERT_RECOMPUTE
    return next((name for name in candidates if name in modules), None)


def recompute_reason(config, surface: str, strategy: str, shared_expert: Optional[bool] = None) -> Optional[str]:
    """Why ``strategy`` is not used for a ``surface`` adapter under the config's recompute settings, or None.

    ``config`` needs ``recompute_granularity`` and ``recompute_modules`` (a TransformerConfig or a
    Bridge model provider); ``MemoryConfig.validate`` asks the same question before the model exists
    (``shared_expert`` None: whether the linear_fc1 is a shared expert's is not known yet).
    """
    if STRATEGIES[strategy].inside_recompute:
        return None
    granularity = getattr(config, "recompute_granularity", None)
    allowed = ", ".join(name for name, s in STRATEGIES.items() if s.inside_recompute)
    if granularity == "full":
        return f"full activation recompute already drops the gathered input ({allowed} is allowed here)"
    module = _fc1_recompute_module(config, shared_expert) if surface == "linear_fc1" else None
    if granularity == "selective" and module:
        which = "a shared expert's linear_fc1" if module in SHARED_EXPERT_RECOMPUTE else "linear_fc1"
        return f"selective '{module}' recompute already covers {which} ({allowed} is allowed here)"
    return None


def ineligibility(wrapper, strategy: str, adapter=None) -> Optional[str]:
    """Why ``adapter`` of a Bridge adapter wrapper (default: ``wrapper.adapter``) cannot use ``strategy``, or None."""
    adapter = wrapper.adapter if adapter is None else adapter
    base_config = wrapper.to_wrap.config
    surface = adapter.base_linear_name.rsplit(".", 1)[-1]
    checks = (
        (surface not in ELIGIBLE_SURFACES, f"{surface} is not a column-parallel LoRA target ({', '.join(ELIGIBLE_SURFACES)})"),
        (adapter.input_is_parallel, "the adapter is row-parallel"),
        (getattr(adapter, "is_expert", False), "expert adapters are not supported: " + EXPERT_INPUT),
        (not base_config.sequence_parallel, "sequence parallelism is off (nothing to save)"),
        (_tp_size(adapter) <= 1, "tensor parallel size is 1 (nothing to save)"),
        (getattr(adapter, "use_a2a", False), "all-to-all adapters are not supported"),
        (_base_skips_sequence_parallel_comm(wrapper.to_wrap), "the base linear does no sequence-parallel communication"),
        (not adapter.linear_in.weight.requires_grad, "LoRA-A is frozen (its input is not retained anyway)"),
        (type(adapter.activation).__name__ != "Identity", "the adapter activation is not identity"),
        (getattr(base_config, "cuda_graph_impl", "none") not in (None, "none") or getattr(base_config, "enable_cuda_graph", False),
         "CUDA graphs are enabled"),
        (bool(getattr(base_config, "cpu_offloading", False) and getattr(base_config, "cpu_offloading_activations", False)),
         "CPU activation offloading is enabled"),
    )
    for failed, reason in checks:
        if failed:
            return reason
    return recompute_reason(base_config, surface, strategy, shared_expert=is_shared_expert(adapter.base_linear_name))


def is_te_layernorm_linear(base) -> bool:
    """A Transformer Engine LayerNorm-linear (it can return its norm output, gathered or not)."""
    return hasattr(base, "return_layernorm_output_gathered")


def _drops_its_input(adapter) -> bool:
    """Adapter dropout before LoRA-A: LoRA-A then gets (and keeps) a dropped copy of the input of its own."""
    dropout = getattr(adapter, "dropout", None)
    return (dropout is not None and type(dropout).__name__ != "Identity"
            and getattr(adapter, "dropout_position", "pre") == "pre")


def retained(wrapper, strategy: str, adapter=None, shared_by: int = 1) -> str:
    """What LoRA-A keeps for backward when ``strategy`` (or ``"off"``) is in effect, and what that saves.

    ``shared_by``: how many adapters of the wrapper take the same input (CanonicalLoRA: 2 or 3).
    Without adapter dropout they keep one storage between them; with it each keeps its own.
    """
    adapter, base = (wrapper.adapter if adapter is None else adapter), wrapper.to_wrap
    if not adapter.linear_in.weight.requires_grad:
        return "nothing (LoRA-A is frozen)"
    if adapter.input_is_parallel:
        return "its input as the row-parallel base gets it, already split over TP ([s, b, h/t]); nothing to save"
    if getattr(adapter, "is_expert", False):
        return "the tokens the dispatcher routed to this expert, as Bridge does; nothing to save"
    sequence_parallel = getattr(base.config, "sequence_parallel", False) and _tp_size(adapter) > 1
    if not sequence_parallel:
        return "its input [s, b, h] (no sequence parallelism: nothing to save)"
    te = is_te_layernorm_linear(base)
    n = 1 if _drops_its_input(adapter) else shared_by
    if strategy == OFF:
        if shared_by == 1:
            return "the gathered input [s, b, h]"
        if te and n > 1:
            return f"the gathered norm output [s, b, h], one copy for the {n} adapters of this layer"
        return "its own gathered copy of the input [s, b, h]"
    if _drops_its_input(adapter):
        return ("its own dropped sequence shard [s/t, b, h] (adapter dropout): s*b*h*(1-1/t) elements less than "
                "Bridge's dropped and gathered copy")
    if te and getattr(base.config, "fp8", None):
        shared = f", one storage for the {n} adapters of this layer" if n > 1 else ""
        return (f"the returned sequence shard [s/t, b, h]{shared}, next to the quantised copy TE keeps under FP8: "
                "s*b*h*(1-1/t) elements less than Bridge's gathered copy")
    if te:
        shared = f", one storage for the {n} adapters of this layer" if n > 1 else ""
        return (f"the sequence shard [s/t, b, h], the storage TE keeps for its own backward{shared}: "
                "s*b*h elements less than Bridge (which also keeps the gathered copy)")
    if is_shared_expert(adapter.base_linear_name):
        shared = f", one storage for the {n} adapters of this layer" if n > 1 else ""
        return (f"the sequence shard [s/t, b, h], the MoE layer's input that Core's router keeps for its own "
                f"backward{shared}: s*b*h*{n} elements less than Bridge's gathered cop{'ies' if n > 1 else 'y'}")
    if n > 1:
        return (f"the sequence shard [s/t, b, h], one storage for the {n} adapters of this layer: s*b*h*({n}-1/t) "
                f"elements less than Bridge's {n} gathered copies")
    return "the sequence shard [s/t, b, h]: s*b*h*(1-1/t) elements less than Bridge's gathered input"


def _adapter_name(adapter, path: str) -> str:
    """The adapted layer's name, with the adapter's key where a wrapper holds several (``...linear_qkv.adapter_q``)."""
    key = path.rsplit(".", 1)[-1]
    return adapter.base_linear_name if path == "adapter" else f"{adapter.base_linear_name}.{key}"


def decide_wrapper(wrapper, strategy: str, adapters: list[tuple[str, object]],
                   reason: Optional[str] = None) -> list[Decision]:
    """The decisions for the adapters of one Bridge wrapper, each given as (module path under the wrapper, adapter).

    The adapters of a wrapper all take the same input (the base layer's), so they take it the same way:
    the strategy applies to all of them or to none, with the first reason found (``reason``, from the
    PEFT kind, comes first).
    """
    if strategy == OFF:
        reason = "off (no strategy requested)"
    else:
        reason = reason or next((r for _, a in adapters if (r := ineligibility(wrapper, strategy, a))), None)
    chosen = strategy if reason is None else OFF
    return [Decision(_adapter_name(a, path), strategy, chosen, reason or "eligible",
                     retained(wrapper, chosen, a, len(adapters)), f"{a.base_linear_name}.{path}.linear_in")
            for path, a in adapters]


def decide(lora_linear, strategy: str) -> Decision:
    """The decision for one Bridge ``LoRALinear`` under the requested strategy (``"off"`` included)."""
    return decide_wrapper(lora_linear, strategy, [("adapter", lora_linear.adapter)])[0]
