"""``mbx demo --bridge``: LoRA fine-tuning of a tiny GPT through Megatron Bridge's own pretrain/finetune loop.

Every run goes through Bridge's real entry points (:mod:`megatron_bridge_ext.testing.bridge.runner`) on the
tiny recipe (:mod:`megatron_bridge_ext.testing.bridge.recipe`): the base model is pretrained, then each
variant of :data:`BRIDGE_VARIANTS` fine-tunes it, measured inside the loop; rank 0 prints
:mod:`.bridge_table`'s tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Optional

from megatron_bridge_ext.demo.bridge_table import format_tables, row
from megatron_bridge_ext.testing.bridge.recipe import TENSOR_PARALLEL, finetune_config, pretrain_config
from megatron_bridge_ext.testing.bridge.runner import run

BRIDGE_VARIANTS = ("baseline", "shard_local", "shard_local+core_attn")
"""The variants of :mod:`megatron_bridge_ext.testing.variants` this demo fine-tunes, Bridge's LoRA first."""


def _steps(text: str) -> int:
    from megatron_bridge_ext.demo.options import _positive_int

    value = _positive_int(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"{value} is more than 100 (this is a demo: a few steps show the numbers)")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mbx demo --bridge", description="LoRA fine-tuning of a tiny GPT through Megatron Bridge's own "
        "pretrain/finetune loop: Bridge's LoRA and ours (MemoryConfig) side by side, memory measured inside the loop")
    p.add_argument("--steps", type=_steps, default=4, help="fine-tuning iterations per variant (1-100)")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="keep the checkpoints in DIR (DIR/base is the base model the docs' finetune_lora.py "
                        "example fine-tunes); default: a temporary directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(tp=TENSOR_PARALLEL)  # ranks started
    return p


def _variant_config(base: str, steps: int, variant):
    cfg = finetune_config(base, train_iters=steps)
    variant.apply_to_bridge(cfg)
    return cfg


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: pretrain the base, fine-tune each variant through Bridge's loop, print on rank 0.

    Bridge's own log goes to stderr, so that stdout holds the tables (or the JSON) only.
    """
    import torch.distributed as dist

    import megatron_bridge_ext
    from megatron_bridge_ext.testing import distributed, variants

    megatron_bridge_ext.init()
    if not dist.is_initialized():  # ours: Bridge then leaves the process group alive between runs
        dist.init_process_group(backend=distributed.backend_for_device(), timeout=distributed.DEFAULT_TIMEOUT)
    rank = dist.get_rank()
    with contextlib.ExitStack() as stack:
        local = os.path.abspath(args.keep) if args.keep else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="mbx-bridge-demo-"))
        shared = [local if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        base = os.path.join(shared[0], "base")
        with contextlib.redirect_stdout(sys.stderr):
            run("pretrain", pretrain_config(base))
            rows = [row(v.name, run("finetune", _variant_config(base, args.steps, v), meter=True))
                    for v in variants.select(list(BRIDGE_VARIANTS))]
        dist.barrier()  # rank 0 removes a temporary directory on exit
    if rank == 0:
        print(json.dumps({"rows": rows}, indent=2) if args.json else format_tables(rows), flush=True)
        if args.keep:
            print(f"base checkpoint kept in {base}", file=sys.stderr)
    dist.destroy_process_group()


def _nothing_to_check(args: argparse.Namespace) -> None:
    """argparse already refuses every bad value of this demo's options."""


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_bridge_ext.demo import launch

    argv = list(sys.argv[1:] if argv is None else argv)
    return launch.run("mbx demo --bridge", "megatron_bridge_ext.demo.bridge_loop", parser(), argv, worker,
                      check=_nothing_to_check, bridge=True)


if __name__ == "__main__":
    sys.exit(main())
