"""One measured training step: what a rank holds after forward, at its peak, and what it moved.

Shared by ``scripts/peak_memory.py`` (one GPU, rank 0 of TP=2 through a fake process group) and
``tests/functional/test_gpu_peak_memory.py`` (two GPUs under NCCL), so both read the same figures the
same way. The step is measured warm: one full step first, so that workspaces and persistent buffers
(Core's global memory buffer, regather's gather buffer) exist before the measured one, as they do from
the second step of a real run on.

What the figures hold, for L layers with LoRA on linear_qkv and linear_fc1 (the eligible adapters)
under sequence parallelism with t ranks: right after forward every eligible adapter's retained input
is alive, so a strategy's drop against the baseline is exactly 2L x s*b*h*bytes*(1-1/t) (minus
regather's persistent buffer, which ``regather_buffer_bytes`` reports apart); at the peak of
forward+backward the adapters of layers whose backward has already run are gone, and the peak falls
where 2L-1 or 2L of them are still alive, depending on the stack's largest transient.
"""

from __future__ import annotations

import torch

from megatron_bridge_ext.measure import CollectiveCounter, SavedActivationMeter
from megatron_bridge_ext.levers.lora_input.sp_lora import REGATHER_BUFFER_NAME


def regather_buffer_bytes() -> int:
    """Bytes of the persistent gather buffer that regather keeps in Megatron Core's global memory buffer."""
    from megatron.core import parallel_state

    buffers = parallel_state.get_global_memory_buffer().buffer
    return sum(t.numel() * t.element_size() for (name, _), t in buffers.items() if name == REGATHER_BUFFER_NAME)


def adapter_bytes(seq: int, micro_batch: int, hidden: int, dtype: torch.dtype, tp: int) -> int:
    """What one eligible adapter's LoRA-A stops retaining on the local spec: s*b*h*bytes*(1-1/t)."""
    element = torch.empty((), dtype=dtype).element_size()
    return seq * micro_batch * hidden * element * (tp - 1) // tp


def _zero_grads(model) -> None:
    for param in model.parameters():
        param.grad = None


def measured_step(model, batch, loss_of, cuda: bool) -> dict:
    """Warm-up step, then one measured forward+backward.

    Returns ``memory_before_step``, ``memory_after_forward`` and ``peak_forward_backward`` (bytes from
    ``torch.cuda``; None without CUDA), ``saved_activation_bytes`` and ``lora_input_saved_bytes``
    (exact, from the autograd graph), ``collective_bytes_per_step`` and ``regather_buffer_bytes``.
    """

    def sync():
        if cuda:
            torch.cuda.synchronize()

    _zero_grads(model)
    loss_of(model, batch).backward()
    _zero_grads(model)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else None
    with SavedActivationMeter(model) as meter, CollectiveCounter() as counter:
        loss = loss_of(model, batch)
        sync()
        after_forward = torch.cuda.memory_allocated() if cuda else None
        loss.backward()
    sync()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    saved = meter.result()
    return {
        "memory_before_step": before, "memory_after_forward": after_forward, "peak_forward_backward": peak,
        "saved_activation_bytes": saved.total_bytes, "lora_input_saved_bytes": saved.module_bytes("lora_input"),
        "collective_bytes_per_step": sum(call.nbytes for call in counter.calls),
        "regather_buffer_bytes": regather_buffer_bytes(),
    }
