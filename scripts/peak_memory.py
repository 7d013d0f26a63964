"""Peak memory of rank 0 of a TP=2 LoRA job, measured on ONE device with a fake 2-rank process group.

The fake group (torch's ``FakeStore`` + ``backend="fake"``) makes collectives no-ops while every
allocation stays real, so one GPU holds exactly what rank 0 of a 2-GPU job holds: its weight
shards, its sequence shard of every activation, the gathered buffers. Numbers are meaningless
(collectives move nothing); memory and time are what we read. Run each variant in a fresh process:

    python scripts/peak_memory.py --variant shard_local --layers 4 --json

On CUDA it reports ``torch.cuda.max_memory_allocated`` over one training step (reset before the
step) and the median step time; on CPU it reports the saved-activation bytes instead (for a dry run).

``--estimate`` adds the memory estimate of the same model (``megatron_bridge_ext.estimate``, traced
on fake tensors in this process): on CUDA its peak, less the optimizer states this bare
forward/backward never allocates, against ``max_memory_allocated`` (target within 5%); everywhere
its saved-activation bytes per microbatch against the meter's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

QWEN3_8B = dict(hidden=4096, ffn=12288, heads=32, kv_heads=8, seq=8192, micro_batch=1, dtype="bfloat16",
                lora_rank=16, swiglu=True, vocab=151936)


def init_fake_tp2() -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)


def main() -> None:
    from megatron_bridge_ext import logs
    from megatron_bridge_ext.demo import tiny_model, variants
    from megatron_bridge_ext.measure import SavedActivationMeter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, choices=sorted(variants.VARIANTS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shape instead of the Qwen3-8B-shaped stack (dry run)")
    p.add_argument("--estimate", action="store_true", help="also compare the memory estimate with the measurement")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    logs.configure()
    if not torch.cuda.is_available():
        from megatron_bridge_ext.demo import cpu_emulation

        cpu_emulation.install()
    else:
        torch.cuda.set_device(0)
    init_fake_tp2()
    fields = {} if args.tiny else QWEN3_8B
    shape = tiny_model.TinyGPTShape(layers=args.layers, tp=2, **fields)
    variant = variants.VARIANTS[args.variant]
    model = tiny_model.apply_peft(tiny_model.build_gpt(shape, **variant.config_overrides), variant.make_peft(shape))
    batch = tiny_model.synthetic_batch(shape, 0)
    cuda = torch.cuda.is_available()
    times, peak, saved = [], None, None
    for step in range(args.steps + 1):
        for param in model.parameters():
            param.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with SavedActivationMeter(model) if step == 0 else _null() as meter:
            loss = tiny_model.loss_of(model, batch)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if step == 0:
            saved = meter.result().total_bytes
            if cuda:
                peak = {"max_allocated": torch.cuda.max_memory_allocated(), "before_step": before}
        else:
            times.append((time.perf_counter() - start) * 1e3)
    result = {"variant": args.variant, "shape": vars(shape), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "saved_activation_bytes": saved, "peak": peak, "step_time_ms": statistics.median(times)}
    if args.estimate:
        result["estimate"] = _estimate(shape, variant, cuda, saved, peak)
    print(json.dumps(result) if args.json else result)


def _estimate(shape, variant, cuda: bool, saved: int, peak) -> dict:
    """The estimate of this very run (local spec, unfused attention, one microbatch) next to what was measured."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.device import compare_peak, saved_per_microbatch, tiny_config

    try:
        cfg = tiny_config(shape, variant.make_peft(shape), **variant.config_overrides)
        est = estimate(cfg, attention="local", transformer_impl="local", device="cuda" if cuda else "cpu")
    except Exception as error:  # the measurement above stands on its own; say why the estimate is missing
        return {"error": f"{type(error).__name__}: {error}"}
    out = {"saved_activation_bytes": saved_per_microbatch(est), "saved_matches_meter": saved_per_microbatch(est) == saved,
           "peak_bytes": est.peak_bytes, "components": {c.name: c.bytes for c in est.components}}
    if peak:
        comparison = compare_peak(est, peak["max_allocated"], exclude=["optimizer states"])
        out.update(compared_bytes=comparison.estimate_bytes, relative_error=comparison.relative_error,
                   within_target=comparison.within_target, target=comparison.target, excluded=list(comparison.excluded))
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
