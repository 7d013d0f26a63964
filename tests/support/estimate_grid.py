"""The validation grid of the memory estimate: the estimate's activation bytes against the
saved-activation meter on a real multi-rank CPU run of the demo's tiny model.

Each point is one tiny model (``megatron_bridge_ext.testing.tiny_model``) with one choice of TP, SP,
LoRA-A strategy, recompute, attention heads, MLP and dtype. On every rank the real model runs one
forward under :class:`SavedActivationMeter`, then backward; the same config goes through
``estimate(tiny_config(...), attention="local", transformer_impl="local", device="cpu")``, which
traces rank 0 on fake CPU tensors. LoRA points use our LoRA with each LoRA-A strategy ("off" is
Bridge's path); a few use DoRA and CanonicalLoRA. The two must be equal to the byte, in total, per category and
per layer (all TP ranks hold the same shapes). ``tests/functional/test_estimate_grid.py`` runs the TP 1 and 2 points on the suite's two
ranks; TP 4 needs four ranks: ``python -m megatron_bridge_ext.testing.cpu_run tests.support.estimate_grid
--tp 4 --out FILE`` under ``torchrun --nproc_per_node=4`` (``tests/unit/estimate/test_estimate_grid_tp4.py``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Optional

MHA, GQA = "mha", "gqa"
RECOMPUTE = {
    "none": {},
    "core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@dataclass(frozen=True)
class GridPoint:
    tp: int
    sp: bool
    lora: Optional[str]  # None: full fine-tuning; else our LoRA with this LoRA-A strategy ("off" is Bridge's path)
    recompute: str
    heads: str
    swiglu: bool
    dtype: str
    kind: str = "lora"  # the LoRA-family kind (megatron_bridge_ext.peft.kinds)

    @property
    def name(self) -> str:
        kind = "" if self.kind == "lora" or self.lora is None else f"{self.kind}-"
        return (f"tp{self.tp}-{'sp' if self.sp else 'nosp'}-{kind}{self.lora or 'full_ft'}-{self.recompute}-"
                f"{self.heads}-{'swiglu' if self.swiglu else 'gelu'}-{self.dtype}")

    def shape(self):
        from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

        heads, kv_heads = (4, 4) if self.heads == MHA else ((8, 4) if self.tp == 4 else (4, 2))
        return TinyGPTShape(tp=self.tp, sequence_parallel=self.sp, heads=heads, kv_heads=kv_heads, swiglu=self.swiglu,
                            dtype=self.dtype, peft=self.kind)

    def peft(self, shape):
        if self.lora is None:
            return None
        from megatron_bridge_ext.peft import kinds
        from megatron_bridge_ext.testing.tiny_model import peft_fields

        return kinds.our_class(self.kind)(**peft_fields(shape), sequence_parallel_input_strategy=self.lora)


def _grid() -> list[GridPoint]:
    points = []
    # TP 2 with SP: every LoRA-A strategy with every recompute choice; heads, MLP and dtype rotate.
    strategies = [None, "off", "regather", "shard_local"]
    for i, lora in enumerate(strategies):
        for j, recompute in enumerate(RECOMPUTE):
            k = i + j
            points.append(GridPoint(2, True, lora, recompute, (MHA, GQA)[k % 2], bool(k // 2 % 2), ("float32", "bfloat16")[i % 2]))
    for lora in (None, "off", "shard_local"):
        for dtype in ("float32", "bfloat16"):
            points.append(GridPoint(2, False, lora, "none", GQA, dtype == "bfloat16", dtype))
    # DoRA and CanonicalLoRA (SwiGLU: CanonicalLoRA splits fc1 into up and gate): Bridge's path, where CanonicalLoRA's
    # adapters each gather the layer's input, and a sequence-sharded one.
    points += [GridPoint(2, True, "off", "none", GQA, True, "bfloat16", kind="canonical_lora"),
               GridPoint(2, True, "shard_local", "core_attn", MHA, True, "float32", kind="canonical_lora"),
               GridPoint(2, True, "regather", "none", GQA, True, "bfloat16", kind="dora")]
    for lora in (None, "off"):
        for recompute in ("none", "full"):
            points.append(GridPoint(1, False, lora, recompute, MHA if lora else GQA, recompute == "full",
                                    "bfloat16" if lora else "float32"))
    points += [GridPoint(4, True, None, "none", GQA, True, "bfloat16"),
               GridPoint(4, True, "off", "core_attn", MHA, False, "float32"),
               GridPoint(4, True, "shard_local", "mlp", GQA, True, "bfloat16"),
               GridPoint(4, True, "regather", "full", MHA, True, "float32"),
               GridPoint(4, False, "off", "none", GQA, False, "bfloat16")]
    return points


GRID: list[GridPoint] = _grid()


def points_for(tp: int) -> list[GridPoint]:
    return [p for p in GRID if p.tp == tp]


def measured(point: GridPoint) -> dict:
    """What one forward of the real tiny model saves on this rank (the meter), in total, per category and per
    layer, as the estimate splits it; backward runs afterwards."""
    from megatron_bridge_ext.estimate.trace import classifier, moe_layers_of, split
    from megatron_bridge_ext.measure import SavedActivationMeter
    from megatron_bridge_ext.testing import tiny_model

    shape = point.shape()
    model = tiny_model.build_gpt(shape, **RECOMPUTE[point.recompute])
    peft = point.peft(shape)
    if peft is not None:
        model = tiny_model.apply_peft(model, peft)
    # Contiguous tokens, as Megatron's GPT dataset hands them over: the demo's batch slices one
    # [b, s + 1] tensor, and at TP 1 the embedding keeps its input, i.e. that whole storage (+8 B per row).
    batch = {name: tensor.contiguous() for name, tensor in tiny_model.synthetic_batch(shape).items()}
    with SavedActivationMeter(model, classifier=classifier(moe_layers_of(model))) as meter:
        loss = tiny_model.loss_of(model, batch)
    loss.backward()
    result = meter.result()
    by_category, by_layer = split(result)
    return {"total": result.total_bytes, "by_category": by_category, "by_layer": by_layer}


def estimated(point: GridPoint) -> dict:
    """What the estimate says one microbatch saves on a rank of ``point`` (traced on fake CPU tensors)."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.device import saved_per_microbatch
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    shape = point.shape()
    cfg = tiny_config(shape, point.peft(shape), **RECOMPUTE[point.recompute])
    est = estimate(cfg, attention="local", transformer_impl="local", device="cpu")
    return {"total": saved_per_microbatch(est), "by_category": est.activations_per_microbatch,
            "by_layer": est.activations_per_layer}


def run(points: list[GridPoint]) -> list[dict]:
    """Measure and estimate every point on this rank; one row per point."""
    rows = []
    for point in points:
        real = measured(point)
        rows.append({"point": point.name, "measured": real, "estimated": estimated(point)})
    return rows


def problems(rows: list[dict]) -> list[str]:
    """Every point whose estimate differs from the measurement: in total, in a category or in a layer."""
    out = []
    for row in rows:
        real, est = row["measured"], row["estimated"]
        for view in ("total", "by_category", "by_layer"):
            if est[view] != real[view]:
                out.append(f"{row['point']} {view}: estimated {est[view]}, measured {real[view]}")
        if real["total"] == 0:
            out.append(f"{row['point']}: measured 0 B (a comparison of zeros proves nothing)")
    return out


def main() -> None:
    """Under torchrun with a world of ``--tp`` ranks: run that TP's points, all ranks' verdicts to ``--out``."""
    import torch.distributed as dist

    from megatron_bridge_ext.testing import distributed

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distributed.init_from_env(tensor_parallel=args.tp)
    rows = run(points_for(args.tp))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "rows": rows, "problems": problems(rows)})
    if dist.get_rank() == 0:
        with open(args.out, "w") as handle:
            json.dump(gathered, handle, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
