"""Peak GPU memory with NCCL on >= 2 GPUs: the LoRA-A strategies cut rank 0's peak by the retained bytes.

Skipped without 2 CUDA devices (CI has none). Each variant builds the same model on its rank's GPU;
the peak of one forward/backward (``torch.cuda.max_memory_allocated``, reset after the model is
built) is compared with the baseline's. Expected reduction: every eligible adapter (linear_qkv,
linear_fc1 in each layer) stops retaining (t-1)/t of its gathered [s, b, h] input. Tolerance: 10% of
the expected bytes plus 4 MiB, for allocator rounding (512-byte blocks, 2 MiB segments) and the
transient gather buffers, which the strategies reuse differently.
"""

import pytest
import torch

from megatron_bridge_ext.demo import tiny_model, variants

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL); run on a GPU node"),
]

SHAPE = tiny_model.TinyGPTShape(layers=4, hidden=1024, ffn=4096, heads=16, kv_heads=8, seq=4096, micro_batch=1,
                                dtype="bfloat16", lora_rank=16, swiglu=True)


def _peak(name: str) -> int:
    variant = variants.VARIANTS[name]
    model = tiny_model.apply_peft(tiny_model.build_gpt(SHAPE), variant.make_peft(SHAPE))
    batch = tiny_model.synthetic_batch(SHAPE, 0)
    tiny_model.loss_of(model, batch).backward()  # warm-up: buffers and workspaces exist in every variant
    for param in model.parameters():
        param.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    tiny_model.loss_of(model, batch).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    del model
    torch.cuda.empty_cache()
    return peak


@pytest.mark.parametrize("strategy", ["regather", "shard_local"])
def test_peak_reduction_matches_the_retained_bytes(tp2, strategy):
    element = 2  # bf16
    expected = SHAPE.layers * 2 * SHAPE.seq * SHAPE.micro_batch * SHAPE.hidden * element * (SHAPE.tp - 1) // SHAPE.tp
    reduction = _peak("baseline") - _peak(strategy)
    assert abs(reduction - expected) <= 0.10 * expected + 4 * 2**20, (reduction, expected)
