"""One microbatch through a rank's model on fake tensors, counting what autograd keeps for backward.

The count is :class:`megatron_bridge_ext.measure.SavedActivationMeter`'s, the same meter the tests
and ``mbx bench memory`` read on real runs, with a classifier that sorts the modules into the
estimate's categories. Each storage counts once, in the category of the first module that saved it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_bridge_ext.measure import ROOT, SavedActivationMeter

NORMS = "norms"
ATTENTION = "attention"
MLP = "mlp"
LORA_INPUTS = "lora inputs"
EMBEDDING = "embedding"
LOGITS_LOSS = "logits and loss"
CHECKPOINT_INPUTS = "recompute checkpoints"
CATEGORIES = (EMBEDDING, NORMS, ATTENTION, MLP, LORA_INPUTS, CHECKPOINT_INPUTS, LOGITS_LOSS)


def category_of(module: str) -> str:
    """The estimate's category of a module of a Megatron Core GPTModel, by its qualified name.

    Adapters (``...adapter...``) are LoRA inputs wherever they sit; norms (``*layernorm``) before
    attention and MLP so that q/k norms count as norms; the rotary embedding's cos/sin count with
    attention. Saves made by the decoder itself (outside every layer) are the inputs that full
    recompute checkpoints keep; the model's own forward (``<root>``: the logits cast and the loss)
    and the output layer are logits and loss.
    """
    parts = module.split(".")
    if "adapter" in parts:
        return LORA_INPUTS
    if any(part.endswith("layernorm") for part in parts):
        return NORMS
    if "self_attention" in parts or "rotary_pos_emb" in parts:
        return ATTENTION
    if "mlp" in parts:
        return MLP
    if parts[0] == "embedding":
        return EMBEDDING
    if parts[0] == "decoder":
        return CHECKPOINT_INPUTS
    if module == ROOT or parts[0] == "output_layer":
        return LOGITS_LOSS
    raise ValueError(f"module {module!r} has no estimate category")


@dataclass(frozen=True)
class TracedMicrobatch:
    """What one microbatch saved on this rank, and the buffers the forward left allocated."""

    saved_bytes: int
    by_category: dict[str, int]
    persistent_buffer_bytes: int
    lora_a_saved: dict[str, int]
    """What each LoRA-A (``...adapter.linear_in``) saved, per module (for the TE contract)."""


def trace_microbatch(model: torch.nn.Module, mode, *, seq: int, micro_batch: int, hidden: int, dtype: torch.dtype,
                     device: str, sequence_parallel_tp: int) -> TracedMicrobatch:
    """Run one forward of ``model`` (a GPTModel of one pipeline stage) on fake tensors under the meter.

    The first stage takes token ids; later stages take the previous stage's output [s/t, b, h]
    (sequence shard under SP), as the pipeline schedule hands it over, requiring grad. The last
    stage computes the loss from labels.
    """
    from megatron.core import parallel_state

    with mode:
        ids = torch.zeros(micro_batch, seq, dtype=torch.long, device=device)
        positions = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch, -1)
        labels = ids if model.post_process else None
        if not model.pre_process:
            received = torch.empty(seq // sequence_parallel_tp, micro_batch, hidden, dtype=dtype, device=device,
                                   requires_grad=True)
            model.set_input_tensor(received)
        with SavedActivationMeter(model, classifier=category_of) as meter:
            model(ids, positions, None, labels=labels)
    result = meter.result()
    buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    persistent = sum(t.numel() * t.element_size() for t in getattr(buffer, "buffer", {}).values())
    lora_a = {name: nbytes for name, nbytes in result.by_module.items() if name.endswith("adapter.linear_in")}
    return TracedMicrobatch(result.total_bytes, {c: result.by_category.get(c, 0) for c in CATEGORIES}, persistent,
                            lora_a)
