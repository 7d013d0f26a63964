"""What a LoRA-A input strategy costs in the plan: the collective elements its adapters move."""

from __future__ import annotations

from megatron_bridge_ext.levers.lora_input import sp_lora

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
"""The base layers whose LoRA-A's take a sequence-parallel input."""
FORMULAS = {sp_lora.SHARD_LOCAL: "s*b*r + 3*r*h", sp_lora.REGATHER: "s*b*r + 3*s*b*h"}
"""Per eligible adapter and microbatch, with an input gradient (the counts of :func:`lora_input_collective_elements`)."""


def lora_input_collective_elements(strategy: str, *, seq: int, micro_batch: int, hidden: int, rank: int,
                                   input_needs_grad: bool = True) -> int:
    """Collective elements one eligible LoRA-A adapter moves per microbatch under sequence parallelism.

    Counted as each collective's full (gathered) size. Bridge's path (``off``): all-gather x (s b h)
    and, when x needs a gradient, reduce-scatter its gradient (s b h); ``regather`` all-gathers x
    again in backward for the weight gradient; ``shard_local`` all-gathers A (r h) forward and, with
    an input gradient, backward, and reduce-scatters A's weight gradient (r h). All three gather the
    [s, b, r] LoRA-A output (over the rank dimension, or along the sequence for ``shard_local``).
    The first layer's input under a frozen embedding needs no gradient.
    """
    sbh, sbr, rh = seq * micro_batch * hidden, seq * micro_batch * rank, rank * hidden
    grad = 1 if input_needs_grad else 0
    if strategy == sp_lora.SHARD_LOCAL:
        return sbr + rh + grad * rh + rh
    if strategy == sp_lora.REGATHER:
        return sbr + 2 * sbh + grad * sbh
    return sbr + sbh + grad * sbh


def collective_change(est, strategy: str) -> tuple[int, str]:
    """Change in bytes per step when the adapters of ``est``'s stage (a
    :class:`~megatron_bridge_ext.estimate.report.MemoryEstimate`) switch from their strategy to ``strategy``,
    with its basis."""
    from megatron_bridge_ext.peft import kinds

    s = est.settings
    # One term per LoRA-A of a column-parallel layer (CanonicalLoRA: three on linear_qkv, two on linear_fc1).
    targets = [layer for t in (s.get("lora_targets") or []) for layer in kinds.targeted_layers([t])
               if layer in COLUMN_PARALLEL]
    old = s.get("sequence_parallel_input_strategy") or sp_lora.OFF
    layers, nmb, e = s["layers_on_stage"], s["num_microbatches"], est.element_size()
    kwargs = dict(seq=s["seq_length"], micro_batch=s["micro_batch"], hidden=s["hidden"], rank=s["lora_dim"])
    total = 0
    for layer in range(layers):
        for target in targets:
            needs_grad = not (layer == 0 and est.stage == 0 and target == "linear_qkv")
            total += (lora_input_collective_elements(strategy, **kwargs, input_needs_grad=needs_grad)
                      - lora_input_collective_elements(old, **kwargs, input_needs_grad=needs_grad))
    basis = (f"formula: per eligible adapter and microbatch, {old}: s*b*r + s*b*h (+ s*b*h with an input gradient); "
             f"{strategy}: {FORMULAS[strategy]}; "
             f"x {len(targets)} adapters x {layers} layers x {nmb} microbatches x {e} B")
    return total * nmb * e, basis
