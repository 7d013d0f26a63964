"""What Transformer Engine's fused norm-linear keeps beyond the local layer spec that is traced.

Transformer Engine does not run here, so the estimate traces Megatron Core's local spec (separate
norm, then ``ColumnParallelLinear``) and adds what TE's contract keeps on top of it. TE's
``LayerNormLinear`` (``transformer_engine/pytorch/module/layernorm_linear.py``, autograd function
``_LayerNormLinear``; v2.4 L356-358 and L437-447, main L427-435 and L526-536) saves the norm's
input and statistics, as the local norm does, and its local norm-output shard ``ln_out``
[s/t, b, h], which it drops only when its weight is frozen *and* it does not return the norm
output. Bridge's LoRA makes it return the norm output (``return_layernorm_output=True``), so:

* Bridge's LoRA-A on the gathered path keeps the gathered [s, b, h] norm output, which the local
  spec's trace measures, and TE keeps its shard next to it: **one shard per such adapter is added**;
* our ``regather`` / ``shard_local`` take the non-gathered return, the shard itself: LoRA-A and TE
  keep the same storage, which the trace already counts once: nothing is added;
* a trainable base (full fine-tuning) keeps the norm output either way: nothing is added.

The same contract is implemented, line by line, by the CPU fake the tests use for TE's LoRA path.
"""

from __future__ import annotations

from megatron_bridge_ext.estimate.report import ACTIVATIONS, Component

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")


def is_te_lora_input(module: str) -> bool:
    """LoRA-A of a column-parallel target that TE would fuse with its norm."""
    return any(module.endswith(f"{target}.adapter.linear_in") for target in COLUMN_TARGETS)


def norm_output_shards(lora_a_saved: dict[str, int], *, seq: int, micro_batch: int, hidden: int, tp: int,
                       sequence_parallel: bool, element_size: int) -> tuple[int, int]:
    """(adapters on the gathered path, bytes TE adds per microbatch) from what each LoRA-A saved.

    A LoRA-A that saved at least the gathered [s, b, h] input is on Bridge's gathered path.
    """
    if not sequence_parallel or tp == 1:
        return 0, 0
    gathered = seq * micro_batch * hidden * element_size
    count = sum(1 for module, nbytes in lora_a_saved.items() if is_te_lora_input(module) and nbytes >= gathered)
    return count, count * gathered // tp


def te_component(count: int, per_microbatch: int, in_flight: float, *, shard_shape: str) -> Component:
    return Component(
        ACTIVATIONS, "TE norm-output shards (contract)", round(per_microbatch * in_flight),
        f"Transformer Engine contract: {count} LayerNormLinear(s) whose LoRA-A keeps the gathered norm output also "
        f"keep their own {shard_shape} shard (layernorm_linear.py v2.4 L356-358) x {in_flight:g} microbatch(es)")
