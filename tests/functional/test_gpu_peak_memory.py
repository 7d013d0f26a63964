"""Peak GPU memory with NCCL on >= 2 GPUs: what the LoRA-A strategies take off rank 0, and where.

Skipped without 2 CUDA devices (CI has none; ``scripts/device_check.sh`` runs it on a GPU node).
Each variant builds the same bf16 stack (local spec with a fused attention core, RMSNorm, SwiGLU) on
its rank's GPU and runs one warm step (:func:`megatron_bridge_ext.testing.peak.measured_step`).
Expected figures come from the shape: every eligible adapter (linear_qkv and linear_fc1 of each of
the L layers) stops retaining s*b*h*2*(1-1/t) bytes of its gathered input, so

* right after forward, when all 2L retained inputs are alive, the drop is exactly 2L of them, less
  regather's persistent gather buffer;
* the peak of forward+backward falls where 2L-1 or 2L of them are still alive (the last layer's
  backward frees its two first), so its drop lies between those two.

The allowance is 1 MiB: the tensors themselves are exact multiples of the allocator's 512-byte
blocks; cuBLAS and NCCL workspaces may differ by a block between runs.
"""

import pytest
import torch

from megatron_bridge_ext.testing import peak, sdpa_attention, tiny_model, variants
from tests.support.dist_checks import assert_no_problems

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL); run on a GPU node"),
]

SHAPE = tiny_model.TinyGPTShape(layers=4, hidden=1024, ffn=3072, heads=16, kv_heads=8, seq=8192, micro_batch=1,
                                dtype="bfloat16", lora_rank=16, swiglu=True, vocab=32768)
ALLOWANCE = 1 << 20


def _figures(name: str) -> dict:
    peft, config = variants.VARIANTS[name].apply(SHAPE, normalization="RMSNorm")
    model = tiny_model.build_gpt(SHAPE, layer_spec=sdpa_attention.local_spec_with_sdpa(), normalization="RMSNorm",
                                 **config)
    model = tiny_model.apply_peft(model, peft)
    figures = peak.measured_step(model, tiny_model.synthetic_batch(SHAPE, 0), tiny_model.loss_of, cuda=True)
    del model
    torch.cuda.empty_cache()
    return figures


@pytest.mark.parametrize("strategy", ["regather", "shard_local"])
def test_after_forward_and_peak_drop_are_the_retained_inputs(tp2, strategy):
    adapters = 2 * SHAPE.layers
    worth = peak.adapter_bytes(SHAPE.seq, SHAPE.micro_batch, SHAPE.hidden, torch.bfloat16, SHAPE.tp)
    assert worth == SHAPE.seq * SHAPE.hidden * 2 // 2  # bf16, t=2: half the gathered [s, 1, h] input
    base, row = _figures("baseline"), _figures(strategy)
    buffer = row["regather_buffer_bytes"] - base["regather_buffer_bytes"]
    forward_drop = base["memory_after_forward"] - row["memory_after_forward"] + buffer
    peak_drop = base["peak_forward_backward"] - row["peak_forward_backward"] + buffer
    problems = []
    if abs(forward_drop - adapters * worth) > ALLOWANCE:
        problems.append(f"after-forward drop {forward_drop} B, expected {adapters} x {worth} B")
    if not (adapters - 1) * worth - ALLOWANCE <= peak_drop <= adapters * worth + ALLOWANCE:
        problems.append(f"peak drop {peak_drop} B, expected between {adapters - 1} and {adapters} x {worth} B")
    if strategy == "shard_local" and buffer:
        problems.append(f"shard_local keeps a gather buffer of {buffer} B")
    assert_no_problems(problems, tp2)
