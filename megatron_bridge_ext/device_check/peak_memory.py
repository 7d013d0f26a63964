"""Peak memory of rank 0 of a TP=2 LoRA job, measured on ONE device through a fake 2-rank process group.

    python -m megatron_bridge_ext.device_check.peak_memory --variant shard_local [--layers 4] [--steps 5]
        [--dry-run] [--json]

The fake group (torch's ``FakeStore`` + ``backend="fake"``) makes collectives free no-ops while every
allocation stays real, so one GPU holds exactly what rank 0 of a 2-GPU job holds: its weight shards,
its sequence shard of every activation, the gathered buffers. Values are meaningless (collectives move
nothing); memory and compute time are what we read. Run each variant in a fresh process.

The stack is Qwen3-8B-shaped (hidden 4096, SwiGLU ffn 12288, 32 heads / 8 KV heads, RMSNorm, bf16,
sequence 8192, micro-batch 1), Megatron Core's local layer spec with a fused attention core
(``megatron_bridge_ext.testing.sdpa_attention``: PyTorch's scaled_dot_product_attention, which keeps no
s x s matrix, as TE's fused attention does not), LoRA r=16 on linear_qkv, linear_proj, linear_fc1,
linear_fc2. One warm-up step, then one measured step: ``memory_allocated`` before the step and right
after forward, ``max_memory_allocated`` over forward+backward (reset before the step), the collective
bytes of the step (counted on the fake group), then ``--steps`` timed steps (CUDA events, median).
``--dry-run``: a tiny shape in float32 on the CPU (no CUDA needed): the same code path, with saved
activation bytes instead of allocator figures.

``--estimate`` adds the memory estimate of the same model (``megatron_bridge_ext.estimate``, traced
on fake tensors, its fused-attention stand-in for the SDPA core): on CUDA its peak, less the optimizer
states a bare forward/backward never allocates, against ``max_memory_allocated`` (target within 5%),
and its saved-activation bytes beside the meter's. Tracing needs Bridge's training config, which
imports Hugging Face ``datasets`` (and pyarrow), more than a carried wheel set holds; so the estimate
needs no GPU, ``--estimates FILE`` reads it instead from a file written where Bridge is fully
installed (``--write-estimates FILE``: every variant, the Qwen3-8B and the dry shape at ``--layers``;
the device check carries ``megatron_bridge_ext/device_check/estimates.json``, and a unit test
recomputes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

QWEN3_8B = dict(hidden=4096, ffn=12288, heads=32, kv_heads=8, seq=8192, micro_batch=1, dtype="bfloat16",
                lora_rank=16, swiglu=True, vocab=151936)
DRY = dict(hidden=64, ffn=128, heads=4, kv_heads=2, seq=64, micro_batch=1, dtype="float32", lora_rank=4,
           swiglu=True, vocab=128)


def _init_fake_tp2() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)


def measure(variant_name: str, layers: int, steps: int, dry_run: bool) -> dict:
    import torch

    from megatron_bridge_ext.testing import peak, sdpa_attention, tiny_model, variants

    cuda = torch.cuda.is_available() and not dry_run
    if not cuda:
        from megatron_bridge_ext.testing import cpu_emulation

        cpu_emulation.install()
    else:
        torch.cuda.set_device(0)
    _init_fake_tp2()
    shape = tiny_model.TinyGPTShape(layers=layers, tp=2, **(DRY if dry_run else QWEN3_8B))
    variant = variants.VARIANTS[variant_name]
    peft, config = variant.apply(shape, normalization="RMSNorm")
    model = tiny_model.build_gpt(shape, layer_spec=sdpa_attention.local_spec_with_sdpa(), normalization="RMSNorm",
                                 **config)
    model = tiny_model.apply_peft(model, peft)
    batch = tiny_model.synthetic_batch(shape, 0)

    figures = peak.measured_step(model, batch, tiny_model.loss_of, cuda)
    times = []
    for _ in range(steps):
        for param in model.parameters():
            param.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            tiny_model.loss_of(model, batch).backward()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            tiny_model.loss_of(model, batch).backward()
            times.append((time.perf_counter() - begin) * 1e3)
    return {
        "variant": variant_name, "shape": {k: v for k, v in vars(shape).items() if k != "lora_targets"},
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        **figures, "step_time_ms": statistics.median(times), "steps_timed": steps,
    }


MEASURED_VARIANTS = ("baseline", "upstream_regather", "regather", "shard_local")
"""The variants the device check measures (baseline first), and so the estimates it carries."""
NOT_ALLOCATED = ("optimizer states",)
"""Estimate components a bare forward/backward (no optimizer step) never allocates."""


def estimate_key(variant_name: str, layers: int, dry_run: bool) -> str:
    return f"{'dry' if dry_run else 'qwen3-8b'}/layers={layers}/{variant_name}"


def estimate_of(variant_name: str, layers: int, dry_run: bool) -> dict:
    """The estimate of the model ``measure`` builds: CUDA's dispatch path for the Qwen3-8B shape (fake
    CUDA tensors, no GPU needed), the CPU's for the dry shape. Needs Bridge's training config."""
    from megatron_bridge_ext.testing import tiny_model, variants
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.device import saved_per_microbatch

    shape = tiny_model.TinyGPTShape(layers=layers, tp=2, **(DRY if dry_run else QWEN3_8B))
    variant = variants.VARIANTS[variant_name]
    peft, config = variant.apply(shape, normalization="RMSNorm")
    cfg = tiny_model.tiny_config(shape, peft, normalization="RMSNorm", **config)
    est = estimate(cfg, attention="fused", transformer_impl="local", device="cpu" if dry_run else "cuda")
    return {"saved_activation_bytes": saved_per_microbatch(est), "peak_bytes": est.steady_peak_bytes,
            "components": {c.name: c.bytes for c in est.components}}


def beside(est: dict, result: dict) -> dict:
    """``est`` with, on CUDA, its peak less what a bare step never allocates against the measured peak."""
    from megatron_bridge_ext.estimate.device import PEAK_TARGET, PeakComparison

    out = dict(est)
    measured = result.get("peak_forward_backward")
    if measured:
        compared = est["peak_bytes"] - sum(est["components"][name] for name in NOT_ALLOCATED)
        comparison = PeakComparison(compared, measured, NOT_ALLOCATED, PEAK_TARGET)
        out.update(compared_bytes=compared, relative_error=comparison.relative_error,
                   within_target=comparison.within_target, target=PEAK_TARGET, excluded=list(NOT_ALLOCATED))
    return out


def committed_estimate(path: str, variant_name: str, layers: int, dry_run: bool) -> dict:
    key = estimate_key(variant_name, layers, dry_run)
    with open(path) as handle:
        estimates = json.load(handle)
    if key not in estimates:
        return {"error": f"{path} has no estimate for {key}; write it where Bridge is fully installed: "
                         f"python -m megatron_bridge_ext.device_check.peak_memory --write-estimates {path} "
                         f"--layers {layers}"}
    return estimates[key]


def write_estimates(path: str, layers: int) -> dict:
    out = {}
    for dry_run in (False, True):
        for name in MEASURED_VARIANTS:
            out[estimate_key(name, layers, dry_run)] = estimate_of(name, layers, dry_run)
    with open(path, "w") as handle:
        handle.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return out


def main(argv=None) -> int:
    from megatron_bridge_ext.testing import variants

    p = argparse.ArgumentParser(prog="python -m megatron_bridge_ext.device_check.peak_memory",
                                description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=sorted(variants.VARIANTS), help="the variant to measure (required to measure)")
    p.add_argument("--write-estimates", metavar="FILE",
                   help="write the estimates of every measured variant (Qwen3-8B shape at --layers, dry shape) to FILE")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps after the measured one (at least 5 on a GPU)")
    p.add_argument("--dry-run", action="store_true", help="tiny float32 shape on the CPU: the path, not the figures")
    p.add_argument("--estimate", action="store_true",
                   help="also the memory estimate of the same model beside it (needs Bridge's training config)")
    p.add_argument("--estimates", metavar="FILE", help="the estimate beside it, from FILE (see --write-estimates)")
    p.add_argument("--json", action="store_true", help="one line of JSON")
    args = p.parse_args(argv)
    if args.write_estimates:
        from megatron_bridge_ext import logs

        logs.configure()
        written = write_estimates(args.write_estimates, args.layers)
        print(f"peak_memory: {len(written)} estimates written to {args.write_estimates}")
        return 0
    if not args.variant:
        p.error("--variant is required to measure (or --write-estimates FILE)")
    if args.estimates and args.estimate:
        p.error("--estimate and --estimates FILE: choose one")
    if args.estimates and not os.path.isfile(args.estimates):
        p.error(f"--estimates {args.estimates}: no such file")
    if args.steps < (1 if args.dry_run else 5):
        p.error(f"--steps={args.steps}: time at least {1 if args.dry_run else 5} steps")
    from megatron_bridge_ext import logs

    logs.configure()
    result = measure(args.variant, args.layers, args.steps, args.dry_run)
    if args.estimate:
        result["estimate"] = beside(estimate_of(args.variant, args.layers, args.dry_run), result)
    elif args.estimates:
        est = committed_estimate(args.estimates, args.variant, args.layers, args.dry_run)
        result["estimate"] = est if "error" in est else beside(est, result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
