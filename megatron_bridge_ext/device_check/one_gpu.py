"""Two allocator-level checks that need only ONE GPU, on the validation grid's tiny shapes.

    python -m megatron_bridge_ext.device_check.one_gpu --check meter|lora_saving [--dry-run] [--json]

``meter``: the saved-activation meter against the caching allocator. TP=1 (a one-rank fake process
group), the grid's bf16 GPT with Bridge's LoRA; after a warm-up step, ``torch.cuda.memory_allocated()``
grows during one forward by exactly the blocks of what forward leaves alive: every storage autograd
saved (what the meter counts) and the loss the caller holds.

``lora_saving``: what shard_local takes off rank 0 of TP=2 with sequence parallelism, through a fake
2-rank process group (collectives are free no-ops, every allocation is real): per eligible adapter
(linear_qkv and linear_fc1 of each layer) Bridge's LoRA-A keeps its gathered [s, b, h] input and ours
keeps a [s/t, b, h] shard instead, so the after-forward drop is 2L blocks of the one less 2L blocks of
the other.

Both bounds come from the CUDA caching allocator's rounding (pytorch/pytorch
``c10/cuda/CUDACachingAllocator.cpp`` at 001074d: ``kMinBlockSize = 512``, ``kSmallSize = 1 MiB``,
``round_size``, ``get_pool``, ``should_split``; ``memory_allocated`` is the sum of the allocated
blocks' sizes): a request of n > 0 bytes takes round_size(n) = n rounded up to a multiple of 512;
up to 1 MiB it comes from the small pool, whose blocks are split whenever 512 bytes or more remain,
so its block is exactly round_size(n); a larger one comes from the large pool, which splits only
when more than 1 MiB remains, so its block is round_size(n) plus less than 1 MiB. The grid's tensors
are all small, so the bounds are exact. ``--dry-run`` runs the same path on the CPU and reports the
bounds the GPU run must meet, without allocator figures.
"""

from __future__ import annotations

import argparse
import json
import sys

MIN_BLOCK = 512
"""``kMinBlockSize``: every request is rounded up to a multiple of it."""
SMALL_SIZE = 1 << 20
"""``kSmallSize``: the largest request served from the small pool (its blocks split down to 512 bytes)."""
LOSS_BYTES = 4
"""The loss the caller holds after forward: one float32 scalar (``tiny_model.loss_of``)."""
METER_SHAPE = dict(tp=1, sequence_parallel=False, heads=4, kv_heads=4, swiglu=False, dtype="bfloat16")
"""The grid's TP=1 LoRA point (``tests/support/estimate_grid.py``: MHA, GeLU, bf16, no recompute)."""
SAVING_SHAPE = dict(tp=2, sequence_parallel=True, heads=4, kv_heads=2, swiglu=True, dtype="bfloat16")
"""The grid's TP=2 shape with sequence parallelism (GQA, SwiGLU, bf16)."""
CHECKS = ("meter", "lora_saving")


def block_bounds(nbytes: int) -> tuple[int, int]:
    """The smallest and largest block the caching allocator gives a request of ``nbytes`` (0: no block)."""
    if nbytes <= 0:
        return 0, 0
    rounded = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
    return rounded, rounded if nbytes <= SMALL_SIZE else rounded + SMALL_SIZE - 1


def blocks_bounds(sizes) -> tuple[int, int]:
    """The bounds of the blocks of several requests together."""
    bounds = [block_bounds(n) for n in sizes]
    return sum(low for low, _ in bounds), sum(high for _, high in bounds)


def _span(low: int, high: int) -> str:
    return f"{low:,} B" if low == high else f"{low:,}..{high:,} B"


def judge_meter(row: dict) -> tuple[bool, str]:
    """The allocator's growth over one forward against the blocks of the meter's storages and the loss."""
    low, high = blocks_bounds([*row["saved_storage_bytes"], LOSS_BYTES])
    grown = row["allocated_after_forward"] - row["allocated_before_forward"]
    return low <= grown <= high, (f"memory_allocated grew {grown:,} B over forward; the meter's "
                                  f"{len(row['saved_storage_bytes'])} storages ({sum(row['saved_storage_bytes']):,} B) "
                                  f"and the loss take {_span(low, high)} in 512-byte blocks")


def saving_bounds(shape: dict) -> tuple[int, int]:
    """The after-forward drop from Bridge's LoRA to shard_local: per eligible adapter one gathered-input block
    fewer and one shard block more."""
    import torch

    element = torch.empty((), dtype=getattr(torch, shape["dtype"])).element_size()
    gathered = shape["seq"] * shape["micro_batch"] * shape["hidden"] * element
    adapters = 2 * shape["layers"]
    (g_low, g_high), (s_low, s_high) = block_bounds(gathered), block_bounds(gathered // shape["tp"])
    return adapters * (g_low - s_high), adapters * (g_high - s_low)


def judge_saving(base: dict, ours: dict) -> tuple[bool, str]:
    """Bridge's LoRA (``base``) against shard_local (``ours``): the drop of what forward leaves allocated."""
    low, high = saving_bounds(base["shape"])
    grown = {name: row["memory_after_forward"] - row["memory_before_step"] for name, row in
             (("base", base), ("ours", ours))}
    drop = grown["base"] - grown["ours"]
    return low <= drop <= high, (f"after-forward drop {drop:,} B; expected {2 * base['shape']['layers']} adapters x "
                                 f"(gathered input block - shard block) = {_span(low, high)}")


def _fake_world(tp: int) -> None:
    """A fake process group of ``tp`` ranks seen from rank 0, and Megatron Core's parallel state on it."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)


def _model(shape, variant_name: str):
    from megatron_bridge_ext.testing import tiny_model, variants

    peft, config = variants.VARIANTS[variant_name].apply(shape)
    return tiny_model.apply_peft(tiny_model.build_gpt(shape, **config), peft)


def _storage_meter(model):
    """The saved-activation meter, also keeping the size of each storage it counts (the allocator rounds each)."""
    from megatron_bridge_ext.measure import SavedActivationMeter

    class StorageSizes(SavedActivationMeter):
        def reset(self) -> None:
            super().reset()
            self.sizes: list[int] = []

        def _add_storage(self, key, module, nbytes) -> None:
            if key not in self._parameter_keys:
                self.sizes.append(nbytes)
            super()._add_storage(key, module, nbytes)

    return StorageSizes(model)


def measure_meter(cuda: bool) -> dict:
    """One warm-up step, then one forward under the meter with ``memory_allocated`` before and after."""
    import torch

    from megatron_bridge_ext.testing import tiny_model

    shape = tiny_model.TinyGPTShape(**METER_SHAPE)
    model = _model(shape, "baseline")
    batch = tiny_model.synthetic_batch(shape, 0)
    tiny_model.loss_of(model, batch).backward()
    for param in model.parameters():
        param.grad = None
    allocated = torch.cuda.memory_allocated if cuda else (lambda: None)
    if cuda:
        torch.cuda.synchronize()
    before = allocated()
    with _storage_meter(model) as meter:
        loss = tiny_model.loss_of(model, batch)
        if cuda:
            torch.cuda.synchronize()
        after = allocated()
    result = meter.result()
    del loss
    return {"check": "meter", "shape": _shape_dict(shape), "allocated_before_forward": before,
            "allocated_after_forward": after, "saved_activation_bytes": result.total_bytes,
            "saved_storage_bytes": meter.sizes}


def measure_saving(cuda: bool) -> dict:
    """Bridge's LoRA and shard_local on the same shape, each measured warm (:func:`..testing.peak.measured_step`)."""
    import torch

    from megatron_bridge_ext.testing import peak, tiny_model

    shape = tiny_model.TinyGPTShape(**SAVING_SHAPE)
    rows = {}
    for name in ("baseline", "shard_local"):
        model = _model(shape, name)
        rows[name] = {"shape": _shape_dict(shape), **peak.measured_step(
            model, tiny_model.synthetic_batch(shape, 0), tiny_model.loss_of, cuda)}
        del model
        if cuda:
            torch.cuda.empty_cache()
    return {"check": "lora_saving", **rows}


def _shape_dict(shape) -> dict:
    return {k: v for k, v in vars(shape).items() if k != "lora_targets"}


def verdict(result: dict, cuda: bool) -> tuple[str, str]:
    """``pass``/``FAIL`` with CUDA; on the CPU ``dry run`` with the bounds the GPU must meet (and, for the saving,
    the meter's drop, which must be 2L adapters x s*b*h*bytes*(1-1/t) exactly)."""
    if result["check"] == "meter":
        if cuda:
            ok, detail = judge_meter(result)
            return ("pass" if ok else "FAIL"), detail
        low, high = blocks_bounds([*result["saved_storage_bytes"], LOSS_BYTES])
        return "dry run", (f"needs CUDA for memory_allocated; the meter's {len(result['saved_storage_bytes'])} "
                           f"storages and the loss take {_span(low, high)} in 512-byte blocks: the GPU's growth over "
                           "forward must be that")
    base, ours = result["baseline"], result["shard_local"]
    if cuda:
        ok, detail = judge_saving(base, ours)
        return ("pass" if ok else "FAIL"), detail
    from megatron_bridge_ext.testing.peak import adapter_bytes

    shape = base["shape"]
    import torch

    worth = adapter_bytes(shape["seq"], shape["micro_batch"], shape["hidden"], getattr(torch, shape["dtype"]),
                          shape["tp"])
    drop = base["saved_activation_bytes"] - ours["saved_activation_bytes"]
    low, high = saving_bounds(shape)
    ok = drop == 2 * shape["layers"] * worth
    return ("dry run" if ok else "FAIL"), (f"needs CUDA for memory_allocated; saved-activation drop {drop:,} B, "
                                           f"expected {2 * shape['layers']} x {worth:,} B; the GPU's after-forward "
                                           f"drop must be {_span(low, high)}")


NAMES = {"meter": "one GPU: saved-activation meter vs memory_allocated (TP=1)",
         "lora_saving": "one GPU: shard_local's saving at rank 0 of TP=2 (fake group)"}


def part(check, cuda: bool, run) -> None:
    """The device check's part: each check in its own process (``run``: the check's timed runner), one verdict
    each; ``check``'s report gains their rows under ``one_gpu``."""
    rows = {}
    for name in CHECKS:
        command = [sys.executable, "-m", __spec__.name, "--check", name, "--json"] + ([] if cuda else ["--dry-run"])
        code, out, err = run(command, 150)
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        rows[name] = json.loads(lines[-1]) if code == 0 and lines else {"error": f"exit {code}: {err[-1500:]}"}
        check.part("one_gpu", rows)
        row = rows[name]
        check.verdict(NAMES[name], row.get("status", "FAIL"), row.get("detail", row.get("error", ""))[-300:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_bridge_ext.device_check.one_gpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--check", required=True, choices=CHECKS, help="which of the two checks to run")
    p.add_argument("--dry-run", action="store_true", help="the CPU path on the same shapes, without allocator figures")
    p.add_argument("--json", action="store_true", help="one line of JSON")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        from megatron_bridge_ext.testing import cpu_emulation

        cpu_emulation.install()
    else:
        torch.cuda.set_device(0)
    _fake_world(1 if args.check == "meter" else SAVING_SHAPE["tp"])
    result = measure_meter(cuda) if args.check == "meter" else measure_saving(cuda)
    result["status"], result["detail"] = verdict(result, cuda)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
