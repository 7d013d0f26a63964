"""``mbx bench memory``: the LoRA-A input variants side by side on identical weights and data.

For each variant, on every rank: build the same tiny model (same seeds), apply the variant's PEFT of
the ``--peft`` kind (LoRA, DoRA or CanonicalLoRA), run one instrumented forward/backward
(saved-activation bytes; the bytes LoRA-A modules retain, each storage once, so that the shard
CanonicalLoRA's adapters of a layer share counts once; collective elements per kind and in total;
loss and gradients for parity against the baseline), one warm-up pass, then
``--steps`` timed forward/backward passes without instruments (``step_time_ms`` is their median).
Rank 0 prints rank 0's figures (ranks are symmetric); parity errors are the maximum over ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_bridge_ext.demo import launch, options
from megatron_bridge_ext.measure import CollectiveCounter, SavedActivationMeter
from megatron_bridge_ext.table import text_table
from megatron_bridge_ext.testing import distributed, tiny_model, variants

DEFAULT_SHAPE = tiny_model.TinyGPTShape(layers=2, hidden=256, ffn=512, heads=8, kv_heads=4, seq=256, micro_batch=2,
                                        lora_rank=16)


def parser() -> argparse.ArgumentParser:
    p = options.parser("mbx bench memory", __doc__.splitlines()[0], DEFAULT_SHAPE, steps=5,
                       variant_names=[v.name for v in variants.select(None)],
                       steps_help="timed forward/backward passes per variant (after one warm-up pass)")
    return p


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _forward_backward(model, batch) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    loss = tiny_model.loss_of(model, batch)
    loss.backward()
    return loss.detach()


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.double().abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((value.double() - reference.double()).abs().max() / scale)


def run_variant(shape: tiny_model.TinyGPTShape, variant: variants.Variant, steps: int) -> tuple[dict, dict]:
    """One variant's figures on this rank, and its loss and gradients for parity."""
    peft, config = variant.apply(shape)
    model = tiny_model.apply_peft(tiny_model.build_gpt(shape, **config), peft)
    batch = tiny_model.synthetic_batch(shape, 0)
    with SavedActivationMeter(model) as meter, CollectiveCounter() as counter:
        loss = _forward_backward(model, batch)
    outputs = {"loss": loss.reshape(1)}
    outputs.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    _forward_backward(model, batch)  # warm-up outside the instruments
    times = []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        _forward_backward(model, batch)
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    saved = meter.result()
    row = {
        "name": variant.name,
        "saved_bytes": saved.total_bytes,
        "lora_input_saved_bytes": saved.by_category.get("lora_input", 0),
        "collective_elements": {**counter.elements_by_kind(), "total": counter.total_elements()},
        "step_time_ms": statistics.median(times),
    }
    return row, outputs


def _parity(outputs: dict, reference: dict) -> float:
    if outputs.keys() != reference.keys():
        raise RuntimeError(f"gradient sets differ from the baseline: {sorted(outputs.keys() ^ reference.keys())}")
    local = max(_relative_error(outputs[k], reference[k]) for k in reference)
    value = torch.tensor([local], dtype=torch.float64, device=distributed.device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def run(shape: tiny_model.TinyGPTShape, names: list[str] | None, steps: int) -> dict:
    chosen = variants.select(names, shape.peft)
    rows, reference = [], None
    for variant in chosen:
        row, outputs = run_variant(shape, variant, steps)
        reference = outputs if reference is None else reference
        row["parity_max_rel_err"] = _parity(outputs, reference)
        rows.append(row)
    base_time = rows[0]["step_time_ms"]
    for row in rows:
        row["step_time_ratio"] = row["step_time_ms"] / base_time
    keys = ("name", "saved_bytes", "lora_input_saved_bytes", "collective_elements", "step_time_ms",
            "step_time_ratio", "parity_max_rel_err")
    return {"tp": shape.tp, "shape": vars(shape), "variants": [{k: r[k] for k in keys} for r in rows]}


def format_table(result: dict) -> str:
    s = result["shape"]
    header = (f"mbx bench memory: {s['peft']}, TP={result['tp']}, seq {s['seq']}, micro-batch {s['micro_batch']}, "
              f"hidden {s['hidden']}, ffn {s['ffn']}{' (SwiGLU)' if s['swiglu'] else ''}, heads {s['heads']}/"
              f"{s['kv_heads']}, layers {s['layers']}, r={s['lora_rank']}, "
              f"{s['dtype']} (figures of rank 0; first variant is the reference)")
    cols = ["variant", "saved bytes", "LoRA-A input bytes", "collective elements", "step ms", "ratio",
            "parity rel err"]
    body = [[r["name"], f"{r['saved_bytes']:,}", f"{r['lora_input_saved_bytes']:,}",
             f"{r['collective_elements'].get('total', 0):,}", f"{r['step_time_ms']:.1f}",
             f"{r['step_time_ratio']:.3f}", f"{r['parity_max_rel_err']:.2e}"] for r in result["variants"]]
    note = ("local spec: a LoRA-A strategy saves s*b*h*bytes*(n-1/t) per adapted linear_qkv or linear_fc1 with n "
            "adapters (1 for LoRA and DoRA, 3 and 2 for CanonicalLoRA); under Transformer Engine's LayerNorm-linear, "
            "which keeps its own norm-output shard, it saves s*b*h*bytes per such layer")
    return header + "\n" + text_table(cols, body, right_aligned=True) + "\n" + note


def worker(args: argparse.Namespace) -> None:
    from megatron_bridge_ext import logs

    logs.configure(verbose=args.verbose)
    shape = options.shape_from_args(args)
    distributed.init_from_env(tensor_parallel=shape.tp)
    result = run(shape, args.variants, args.steps)
    if dist.get_rank() == 0:
        table = format_table(result)
        print(json.dumps(result, indent=2) if args.json else table)
        if args.save:
            with open(args.save + ".txt", "w") as out:
                out.write(table + "\n")
            with open(args.save + ".json", "w") as out:
                out.write(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return launch.run("mbx bench memory", "megatron_bridge_ext.demo.bench", parser(), argv, worker)


if __name__ == "__main__":
    sys.exit(main())
