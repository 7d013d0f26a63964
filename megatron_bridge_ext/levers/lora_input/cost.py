"""What a LoRA-A input strategy costs in the plan: the collective elements its adapters move."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_bridge_ext.levers.lora_input import collectives

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.settings import Settings

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
"""The base layers whose LoRA-A's take a sequence-parallel input."""


def lora_input_collective_elements(strategy: str, *, seq: int, micro_batch: int, hidden: int, rank: int,
                                   input_needs_grad: bool = True) -> int:
    """Collective elements one eligible LoRA-A adapter moves per microbatch under sequence parallelism.

    The strategy's collectives (:data:`.collectives.COLLECTIVES`, ``off`` being Bridge's path), each
    counted at its full (gathered) size. The first layer's input under a frozen embedding needs no
    gradient.
    """
    elements = {"s*b*r": seq * micro_batch * rank, "s*b*h": seq * micro_batch * hidden, "r*h": rank * hidden}
    return sum(n * elements[size]
               for size, n in collectives.counts(strategy, input_needs_grad=input_needs_grad).items())


def _targets(s: Settings) -> list[str]:
    """One entry per LoRA-A of a column-parallel layer (CanonicalLoRA: three on linear_qkv, two on linear_fc1)."""
    from megatron_bridge_ext.peft import kinds

    return [layer for t in (s.peft.lora_targets if s.peft else ()) for layer in kinds.targeted_layers([t])
            if layer in COLUMN_PARALLEL]


def _layers_with(s: Settings, target: str) -> int:
    """The stage's layers whose ``target`` is an eligible LoRA surface: linear_qkv on every GPT layer (a hybrid
    model's attention layers); linear_fc1 on dense layers (a hybrid model's MLP layers) and on MoE layers only
    through their shared experts (``s.moe.shared_ffn``): a routed expert's linear_fc1 takes the dispatched tokens."""
    from megatron_bridge_ext.levers.parallelism.cost import layer_counts

    if s.hybrid is not None:
        counts = layer_counts(s, None)
        attention, dense, moe_layers = counts.attention, counts.mlp, counts.moe
    else:
        moe_layers = s.moe.layers_on_stage if s.moe else 0
        attention, dense = s.layers_on_stage, s.layers_on_stage - moe_layers
    if target == "linear_qkv":
        return attention
    return dense + (moe_layers if s.moe and s.moe.shared_ffn else 0)


def eligible_adapters(s: Settings) -> int:
    """The stage's LoRA-A adapters on eligible surfaces (:func:`_layers_with` per entry of :func:`_targets`)."""
    return sum(_layers_with(s, target) for target in _targets(s))


def collective_elements(s: Settings, strategy: str, *, stage: int) -> int:
    """Collective elements the eligible adapters of a stage move per microbatch under ``strategy``
    (``s``: the estimate's settings; on stage 0 of a GPT model the first linear_qkv's input needs no gradient)."""
    kwargs = dict(seq=s.seq_length, micro_batch=s.micro_batch, hidden=s.hidden, rank=s.peft.lora_dim)
    first = stage == 0 and s.hybrid is None  # a hybrid model opens with its pattern's first layer
    return sum(lora_input_collective_elements(strategy, **kwargs,
                                              input_needs_grad=not (layer == 0 and first and target == "linear_qkv"))
               for target in _targets(s) for layer in range(_layers_with(s, target)))


def collective_change(est, strategy: str) -> tuple[int, str]:
    """Change in bytes per step when the adapters of ``est``'s stage (a
    :class:`~megatron_bridge_ext.estimate.report.MemoryEstimate`) switch from their strategy to ``strategy``,
    with its basis."""
    s = est.settings
    old = s.peft.sequence_parallel_input_strategy
    layers, nmb, e = s.layers_on_stage, s.num_microbatches, est.element_size()
    total = collective_elements(s, strategy, stage=est.stage) - collective_elements(s, old, stage=est.stage)
    basis = (f"formula: per eligible adapter and microbatch, {old}: {collectives.formula(old, input_needs_grad=False)} "
             f"(+ {collectives.input_grad_formula(old)} with an input gradient); "
             f"{strategy}: {collectives.formula(strategy)}; "
             f"x {eligible_adapters(s)} eligible adapters on the stage's {layers} layers x {nmb} microbatches x {e} B")
    return total * nmb * e, basis
