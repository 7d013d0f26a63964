"""The main job: train the tiny LoRA model a few steps per variant and show activation memory.

Run ``mbx demo`` (it starts one rank per ``--tp``, 2 by default) or, under torchrun,
``torchrun --nproc_per_node=2 -m megatron_bridge_ext.demo.train`` on GPUs.
Each rank trains the same tiny Megatron Core GPT (TP=2, sequence parallel) with LoRA on
synthetic tokens, once per variant, from identical weights and data, and measures the bytes
autograd retains for backward in every step, split into LoRA-A inputs / attention / other.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from megatron_bridge_ext.demo import launch, options
from megatron_bridge_ext.levers.recompute.probe import RecomputeProbe
from megatron_bridge_ext.measure import SavedActivationMeter
from megatron_bridge_ext.table import text_table
from megatron_bridge_ext.testing import distributed, tiny_model, variants

CATEGORIES = ("lora_input", "attention", "other")


def parser() -> argparse.ArgumentParser:
    p = options.parser("mbx demo", __doc__.splitlines()[0], tiny_model.TinyGPTShape(), steps=3,
                       variant_names=[v.name for v in variants.select(None)], steps_help="training steps per variant")
    p.add_argument("--bridge", action="store_true",
                   help="instead: LoRA fine-tuning through Megatron Bridge's own pretrain/finetune loop "
                        "(options: mbx demo --bridge --help)")
    return p


def train_variant(shape: tiny_model.TinyGPTShape, variant: variants.Variant, steps: int, progress) -> dict:
    """Train ``steps`` steps of one variant; return this rank's losses and saved-activation bytes."""
    peft, config = variant.apply(shape)
    model = tiny_model.apply_peft(tiny_model.build_gpt(shape, **config), peft)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    losses, saved = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        batch = tiny_model.synthetic_batch(shape, 0)  # one batch, so the loss shows the adapters learning
        with RecomputeProbe(model) as probe:
            with SavedActivationMeter(model) as meter:
                loss = tiny_model.loss_of(model, batch)
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
        saved.append(meter.result())
        progress.update(1)
    last = saved[-1]
    return {
        "variant": variant.name,
        "rank": dist.get_rank(),
        "losses": losses,
        "saved_bytes_per_step": [s.total_bytes for s in saved],
        "split": {c: last.by_category.get(c, 0) for c in CATEGORIES},
        "core_attn_recompute": probe.as_dict(),
        "lora_report": [vars(d) for d in peft.report()] if hasattr(peft, "report") else [],
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def _figures(row: dict) -> tuple:
    """What a rank's row says: its saved bytes, their split, the recompute counts and the losses."""
    return (row["saved_bytes_per_step"], sorted(row["split"].items()), sorted(row["core_attn_recompute"].items()),
            [round(loss, 6) for loss in row["losses"]])


def format_table(shape: tiny_model.TinyGPTShape, rows: list[dict], backend: str) -> str:
    """Rank 0's row per variant; the last column says whether every other rank reported the same figures."""
    swiglu = " (SwiGLU)" if shape.swiglu else ""
    header = (f"tiny GPT: {shape.layers} layers, hidden {shape.hidden}, ffn {shape.ffn}{swiglu}, heads {shape.heads}/"
              f"{shape.kv_heads} kv, seq {shape.seq}, micro-batch {shape.micro_batch}, {shape.dtype}; TP={shape.tp} "
              f"sequence parallel; {shape.peft} r={shape.lora_rank} on {', '.join(shape.lora_targets)}; {backend}; "
              "figures of rank 0")
    cols = ["variant", "loss first -> last", "saved/step", "saving vs baseline", "LoRA inputs", "attention", "other",
            "core_attn ckpt/recomputed", "other ranks"]
    body = []
    rank0 = [r for r in rows if r["rank"] == 0]
    for r in rank0:
        differ = [str(o["rank"]) for o in rows
                  if o["variant"] == r["variant"] and o["rank"] != 0 and _figures(o) != _figures(r)]
        body.append([r["variant"], f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}", _mib(r["saved_bytes_per_step"][-1]),
                     _saving(r, rank0[0])]
                    + [_mib(r["split"][c]) for c in CATEGORIES]
                    + ["{checkpointed_forwards}/{recomputed}".format(**r["core_attn_recompute"]),
                       f"DIFFER: rank {', '.join(differ)}" if differ else "same"])
    legend = (f"saving vs baseline: saved/step of the first row ({rank0[0]['variant']}) minus this row's, in bytes "
              "and % of the first row's; LoRA inputs / attention / other: where saved/step goes; saved/step: bytes "
              "autograd keeps for backward in the last step")
    return header + "\n" + text_table(cols, body) + "\n" + legend


def _saving(row: dict, reference: dict) -> str:
    """Bytes ``row`` keeps less than ``reference`` in its last step, and their share of the reference's."""
    base = reference["saved_bytes_per_step"][-1]
    saved = base - row["saved_bytes_per_step"][-1]
    return f"{saved:,} B ({100 * saved / base:.1f}%)" if base else f"{saved:,} B"


def format_result(result: dict) -> str:
    """What ``mbx demo`` prints: the table and the LoRA-A input decisions of the run's JSON."""
    shape = tiny_model.TinyGPTShape(**result["shape"])
    return "\n".join(filter(None, [format_table(shape, result["rows"], result["backend"]),
                                   format_report(result["rows"])]))


def format_report(rows: list[dict]) -> str:
    """Per adapter, where the last variant with a report (``LoRA.report()``, ``DoRA.report()``, ...) applied its
    strategy, and why not elsewhere."""
    reported = [r for r in rows if r["rank"] == 0 and r["lora_report"]]
    if not reported:
        return ""
    row = reported[-1]
    lines = [f"LoRA-A input decisions ({row['variant']}; report()):"]
    width = max(len(decision["adapter"]) for decision in row["lora_report"])
    for decision in row["lora_report"]:
        lines.append(f"  {decision['adapter']:<{width}} {decision['strategy']:<12} {decision['reason']}; "
                     f"retains {decision['retains']}")
    return "\n".join(lines)


def worker(args: argparse.Namespace) -> None:
    from megatron_bridge_ext import logs

    logs.configure(verbose=args.verbose)
    shape = options.shape_from_args(args)
    chosen = variants.select(args.variants, shape.peft)
    distributed.init_from_env(tensor_parallel=shape.tp)
    rank = dist.get_rank()
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with tqdm(total=len(chosen) * args.steps, desc="mbx demo", disable=rank != 0 or args.json,
              file=sys.stderr) as progress, logging_redirect_tqdm():  # log lines above the bar, not on it
        rows = [train_variant(shape, v, args.steps, progress) for v in chosen]
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if rank == 0:
        order = {v.name: i for i, v in enumerate(chosen)}
        all_rows = sorted((r for per_rank in gathered for r in per_rank), key=lambda r: (order[r["variant"]], r["rank"]))
        backend = f"{dist.get_world_size()} ranks ({dist.get_backend()}, {distributed.device().type})"
        result = {"shape": vars(shape), "backend": backend, "rows": all_rows}
        print(json.dumps(result, indent=2) if args.json else format_result(result))
        if args.save:
            with open(args.save + ".txt", "w") as out:
                out.write(format_result(result) + "\n")
            with open(args.save + ".json", "w") as out:
                out.write(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--bridge" in argv:
        from megatron_bridge_ext.demo import bridge_loop

        return bridge_loop.main([a for a in argv if a != "--bridge"])
    return launch.run("mbx demo", "megatron_bridge_ext.demo.train", parser(), argv, worker)


if __name__ == "__main__":
    sys.exit(main())
