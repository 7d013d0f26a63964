"""Does this cluster's Transformer Engine drop Megatron Bridge LoRA's input gradient under sequence parallelism?

    torchrun --nproc_per_node=2 scripts/te_lora_grad_check.py [--dtype float32|bfloat16] [--json]
    python scripts/te_lora_grad_check.py --dry-run        (any machine: what it needs, what it would run)

Builds one Megatron Core ``TELayerNormColumnParallelLinear`` (TP=2, sequence parallelism, frozen base),
wraps it with Megatron Bridge's LoRA as shipped, with the ``bridge_lora_te_norm_grad`` patch, and with
megatron_bridge_ext's ``shard_local``, and compares each run's output, input gradient and LoRA gradients
with a dense float64 computation of the same function. Prints the TE version and one verdict:

* ``affected``: Bridge's LoRA as shipped loses the LoRA branch's input gradient (TE >= 2.4); the
  patched path and megatron_bridge_ext's strategies are correct;
* ``not affected``: Bridge's LoRA as shipped is correct on this TE;
* ``unexpected``: something else is off the reference (exit status 1).

Also prints the bytes LoRA-A's input costs each way (under TE the saving is s*b*h*bytes per adapter;
s*b*h*bytes*(1-1/t) under FP8, where TE keeps a quantised copy of the shard that LoRA-A cannot share).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPE = {"seq": 1024, "batch": 2, "hidden": 1024, "out_features": 3072}
TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2}  # relative to max|reference|; the lost gradient is O(1)
RUNS = ("bridge", "bridge_patched", "shard_local")


def _versions() -> dict:
    from megatron_bridge_ext.versions import package_versions

    return package_versions()


def _missing() -> list[str]:
    """What this machine lacks for the check, one phrase each."""
    missing = []
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # not installed, or installed without its CUDA libraries
        missing.append(f"Transformer Engine does not import ({type(error).__name__}: {str(error)[:80]})")
    import torch

    if torch.cuda.device_count() < 2:
        missing.append(f"2 GPUs (found {torch.cuda.device_count()})")
    return missing


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32", help="parameter and activation dtype")
    p.add_argument("--dry-run", action="store_true", help="say what the check needs and would run; run nothing")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def _check(args) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_bridge_ext.levers.lora_input import te_check

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    group = parallel_state.get_tensor_model_parallel_group()
    dtype = getattr(torch, args.dtype)
    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, params_dtype=dtype,
                                 bf16=dtype == torch.bfloat16)

    def make_base():
        torch.manual_seed(7)
        model_parallel_cuda_manual_seed(1234)  # the same weights for every run
        return TELayerNormColumnParallelLinear(
            SHAPE["hidden"], SHAPE["out_features"], config=config, init_method=torch.nn.init.xavier_normal_,
            gather_output=False, bias=False, skip_bias_add=True, is_expert=False, tp_group=group).cuda()

    results = {run: te_check.run_one(make_base, run, group, **SHAPE) for run in RUNS}
    verdict, lines = te_check.verdict(results, TOLERANCE[args.dtype])
    element = torch.tensor([], dtype=dtype).element_size()
    saving = results["bridge_patched"].saved_bytes - results["shard_local"].saved_bytes
    expected = SHAPE["seq"] * SHAPE["batch"] * SHAPE["hidden"] * element
    lines.append(f"LoRA-A input, Bridge's path minus shard_local: {saving} B saved; s*b*h*bytes = {expected} B "
                 f"({'as expected' if saving == expected else 'DIFFERENT'})")
    dist.destroy_process_group()
    return {"versions": _versions(), "dtype": args.dtype, "shape": SHAPE, "verdict": verdict, "lines": lines,
            "errors": {run: r.errors for run, r in results.items()},
            "saved_bytes": {run: r.saved_bytes for run, r in results.items()}, "saving_as_expected": saving == expected}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    versions = _versions()
    te = versions["transformer-engine"] or "not installed"
    if args.dry_run:
        missing = _missing()
        print(f"te_lora_grad_check (dry run): Transformer Engine {te}; torch {versions['torch']}; "
              f"megatron-core {versions['megatron-core']}; megatron-bridge {versions['megatron-bridge']}")
        print(f"would run, on a TELayerNormColumnParallelLinear with TP=2 and sequence parallelism ({args.dtype}, "
              f"{SHAPE}): {', '.join(RUNS)}, each against a dense float64 reference")
        print("needs Transformer Engine and 2 GPUs: " + ("all present; run it with "
              "`torchrun --nproc_per_node=2 scripts/te_lora_grad_check.py`" if not missing else "missing "
              + "; ".join(missing)))
        return 0
    missing = _missing()
    if missing or "LOCAL_RANK" not in os.environ:
        reason = "; ".join(missing) or "not started by torchrun"
        print(f"te_lora_grad_check: needs Transformer Engine and 2 GPUs under torchrun ({reason}). "
              "Fix: run `torchrun --nproc_per_node=2 scripts/te_lora_grad_check.py` on a node with TE, or --dry-run",
              file=sys.stderr)
        return 2
    result = _check(args)
    if int(os.environ.get("RANK", "0")) == 0:
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"Transformer Engine {te}, {args.dtype}: {result['verdict']}")
            print("\n".join(f"  {line}" for line in result["lines"]))
    return 1 if result["verdict"] == "unexpected" or not result["saving_as_expected"] else 0


if __name__ == "__main__":
    sys.exit(main())
