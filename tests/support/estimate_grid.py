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

The mixture-of-experts points (``MOE_GRID``) also count each local expert's tokens in the real run. Where the
router spreads tokens unevenly (top-k below the experts) the estimate is traced at the balanced load and at the
most loaded expert's factor, and the measurement must equal the estimate at the measured load, the linear
prediction between those two traces (:func:`at_measured_load`), while the max-load estimate bounds it.
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
    "moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "mla_up_proj": dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
}
GPT_RECOMPUTE = ("none", "core_attn", "mlp", "full", "moe")
"""The recompute choices of the dense grid (``mla_up_proj`` needs multi-latent attention: MLA_GRID)."""


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
    experts: int = 0  # routed experts per layer (0: dense MLP), each token to top-k of them
    topk: int = 1
    ep: int = 1
    dispatcher: str = "allgather"
    shared_ffn: int = 0  # a shared-expert MLP of this width beside the routed experts (0: none)
    shared_overlap: bool = False
    moe_layer_freq: tuple = ()  # 1 MoE, 0 dense, per layer (empty: every layer MoE)
    mla: bool = False  # multi-latent attention (4 heads, kv_lora_rank 16; qk/rope/v head dims 16/8/12)
    q_lora: Optional[int] = None  # its query latent (then with the query and key-value latent norms)
    rope: str = "yarn"  # its RoPE

    @property
    def name(self) -> str:
        kind = "" if self.kind == "lora" or self.lora is None else f"{self.kind}-"
        moe = f"-moe{self.experts}top{self.topk}ep{self.ep}{self.dispatcher}" if self.experts else ""
        moe += f"-shared{self.shared_ffn}{'overlap' if self.shared_overlap else ''}" if self.shared_ffn else ""
        moe += f"-freq{''.join(map(str, self.moe_layer_freq))}" if self.moe_layer_freq else ""
        moe += f"-mla{self.q_lora or 'noq'}{self.rope}" if self.mla else ""
        return (f"tp{self.tp}-{'sp' if self.sp else 'nosp'}-{kind}{self.lora or 'full_ft'}-{self.recompute}-"
                f"{self.heads}-{'swiglu' if self.swiglu else 'gelu'}-{self.dtype}{moe}")

    def shape(self):
        from megatron_bridge_ext.testing.tiny_model import TinyGPTShape

        heads, kv_heads = (4, 4) if self.heads == MHA else ((8, 4) if self.tp == 4 else (4, 2))
        moe = dict(experts=self.experts, topk=self.topk, ep=self.ep, etp=1, dispatcher=self.dispatcher,
                   shared_ffn=self.shared_ffn, shared_overlap=self.shared_overlap,
                   moe_layer_freq=list(self.moe_layer_freq) or 1) if self.experts else {}
        mla = dict(mla=True, q_lora_rank=self.q_lora, qk_layernorm=self.q_lora is not None,
                   rope_type=self.rope) if self.mla else {}
        return TinyGPTShape(tp=self.tp, sequence_parallel=self.sp, heads=heads, kv_heads=kv_heads, swiglu=self.swiglu,
                            dtype=self.dtype, peft=self.kind, **moe, **mla)

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
        for j, recompute in enumerate(GPT_RECOMPUTE):
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

MOE_GRID: list[GridPoint] = [
    # Every token to every expert (top-k = experts): the real router's load is the balanced load the estimate
    # states, so the experts' and the dispatcher's saves compare to the byte: both dispatchers, shared experts
    # (overlapped with the all-to-all dispatcher, and not), LoRA-A off/regather/shard_local, recompute of the MoE
    # layer, and dense and MoE layers mixed.
    GridPoint(2, True, "off", "none", GQA, True, "bfloat16", experts=2, topk=2, ep=1),
    GridPoint(2, True, "regather", "none", GQA, True, "bfloat16", experts=2, topk=2, ep=1),
    GridPoint(2, True, "shard_local", "none", GQA, True, "bfloat16", experts=2, topk=2, ep=1),
    GridPoint(2, True, None, "none", GQA, True, "bfloat16", experts=2, topk=2, ep=2),
    GridPoint(2, True, "off", "none", MHA, False, "float32", experts=2, topk=2, ep=2),
    GridPoint(1, False, None, "none", GQA, True, "bfloat16", experts=2, topk=2, ep=2),
    GridPoint(1, False, "off", "none", GQA, True, "float32", experts=2, topk=2, ep=1),
    GridPoint(2, True, "shard_local", "none", GQA, True, "bfloat16", experts=2, topk=2, ep=2, dispatcher="alltoall"),
    GridPoint(1, False, None, "none", GQA, True, "float32", experts=2, topk=2, ep=2, dispatcher="alltoall"),
    GridPoint(2, True, "regather", "none", GQA, True, "bfloat16", experts=2, topk=2, ep=1, shared_ffn=32),
    GridPoint(2, True, None, "none", MHA, True, "float32", experts=2, topk=2, ep=2, dispatcher="alltoall",
              shared_ffn=32, shared_overlap=True),
    GridPoint(2, True, "off", "moe", GQA, True, "bfloat16", experts=2, topk=2, ep=2),
    GridPoint(2, True, "shard_local", "none", GQA, True, "bfloat16", experts=2, topk=2, ep=2, moe_layer_freq=(0, 1)),
    # Top-1 and top-2 of 4 experts: the router's real, uneven load (run() measures each local expert's tokens).
    # With EP 1 every expert is local, so the rank's experts receive tokens x top-k however they are split, and
    # the balanced estimate is exact; with EP 2 the rank's two experts receive a data-dependent share, which the
    # estimate predicts at the measured load (problems()).
    GridPoint(2, True, None, "none", GQA, True, "float32", experts=4, topk=1, ep=1),
    GridPoint(2, True, None, "none", GQA, True, "float32", experts=4, topk=2, ep=2),
    GridPoint(1, False, "off", "none", GQA, True, "float32", experts=4, topk=1, ep=2, dispatcher="alltoall"),
]
"""Mixture-of-experts points on the suite's two ranks: EP 1 and 2, TP 1 and 2, LoRA and full fine-tuning."""

MLA_GRID: list[GridPoint] = [
    # Multi-latent attention on Core's local spec (column-parallel down projections), its core attention the CPU
    # twin of the estimate's fused stand-in (megatron_bridge_ext.testing.fused_attention): the query projected
    # directly and through its latent (with the query and key-value norms), TP 1 and 2, SP on and off, YaRN and
    # plain RoPE, mla_up_proj and full recompute, LoRA on the linears the model has, an MoE model.
    GridPoint(1, False, None, "none", MHA, True, "float32", mla=True),
    GridPoint(1, False, None, "mla_up_proj", MHA, True, "bfloat16", mla=True, q_lora=24, rope="rope"),
    GridPoint(2, True, None, "none", MHA, False, "float32", mla=True),
    GridPoint(2, True, None, "none", MHA, True, "bfloat16", mla=True, q_lora=24),
    GridPoint(2, True, None, "mla_up_proj", MHA, True, "float32", mla=True, q_lora=24),
    GridPoint(2, False, None, "mla_up_proj", MHA, True, "bfloat16", mla=True, q_lora=24),
    GridPoint(2, True, "off", "full", MHA, True, "bfloat16", mla=True, q_lora=24),
    GridPoint(2, True, None, "mla_up_proj", MHA, True, "bfloat16", experts=2, topk=2, ep=2, mla=True, q_lora=24),
]
"""Multi-latent attention points on the suite's two ranks."""


def points_for(tp: int) -> list[GridPoint]:
    return [p for p in GRID if p.tp == tp]


def measured(point: GridPoint) -> dict:
    """What one forward of the real tiny model saves on this rank (the meter), in total, per category and per
    layer, as the estimate splits it (full recompute's checkpoints counted by their layer,
    :func:`~megatron_bridge_ext.estimate.trace.checkpoints_by_layer`); backward runs afterwards."""
    import contextlib

    from megatron_bridge_ext.estimate.trace import checkpoints_by_layer, classifier, moe_layers_of, split
    from megatron_bridge_ext.measure import SavedActivationMeter
    from megatron_bridge_ext.testing import tiny_model

    shape = point.shape()
    if point.experts or point.mla:
        from megatron_bridge_ext.testing import distributed

        distributed.init_from_env(tensor_parallel=point.tp, expert_parallel=point.ep, expert_tensor_parallel=1)
    model = tiny_model.build_gpt(shape, **RECOMPUTE[point.recompute])
    if point.mla and type(model.decoder.layers[0].self_attention).__name__ != "MLASelfAttention":
        raise AssertionError(f"{point.name}: the real run built no multi-latent attention")
    peft = point.peft(shape)
    if peft is not None:
        model = tiny_model.apply_peft(model, peft)
    # Contiguous tokens, as Megatron's GPT dataset hands them over: the demo's batch slices one
    # [b, s + 1] tensor, and at TP 1 the embedding keeps its input, i.e. that whole storage (+8 B per row).
    batch = {name: tensor.contiguous() for name, tensor in tiny_model.synthetic_batch(shape).items()}
    tokens: dict[str, int] = {}
    hooks = [module.register_forward_pre_hook(_count_tokens(tokens, name)) for name, module in model.named_modules()
             if _is_local_expert(name)]
    full = RECOMPUTE[point.recompute].get("recompute_granularity") == "full"
    with SavedActivationMeter(model, classifier=classifier(moe_layers_of(model))) as meter, \
            (checkpoints_by_layer(meter) if full else contextlib.nullcontext()):
        loss = tiny_model.loss_of(model, batch)
    for hook in hooks:
        hook.remove()
    loss.backward()
    result = meter.result()
    by_category, by_layer = split(result)
    return {"total": result.total_bytes, "by_category": by_category, "by_layer": by_layer, "expert_tokens": tokens}


def _is_local_expert(name: str) -> bool:
    """A routed expert of this rank (Core's SequentialMLP: ``...mlp.experts.local_experts.N``)."""
    parts = name.split(".")
    return len(parts) > 2 and parts[-2] == "local_experts" and parts[-1].isdigit()


def _count_tokens(tokens: dict, name: str):
    """A pre-hook noting the tokens the router sent to the expert ``name`` on this rank (its input's rows)."""

    def hook(module, args):
        tokens[name] = args[0].shape[0]

    return hook


def estimated(point: GridPoint, imbalance: float = 1.0) -> dict:
    """What the estimate says one microbatch saves on a rank of ``point`` (traced on fake CPU tensors), at the expert
    load ``imbalance`` (``moe_imbalance``)."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.device import saved_per_microbatch
    from megatron_bridge_ext.testing.tiny_model import tiny_config

    shape = point.shape()
    cfg = tiny_config(shape, point.peft(shape), **RECOMPUTE[point.recompute])
    # Core's local attention cannot take multi-latent attention: the real run has the fused stand-in's CPU twin
    est = estimate(cfg, attention="fused" if point.mla else "local", transformer_impl="local", device="cpu",
                   moe_imbalance=imbalance)
    if point.mla and est.settings.mla is None:
        raise AssertionError(f"{point.name}: the estimate traced no multi-latent attention")
    return {"total": saved_per_microbatch(est), "by_category": est.activations_per_microbatch,
            "by_layer": est.activations_per_layer,
            "routed": est.settings.moe.routed_tokens_per_layer if est.settings.moe else 0,
            "imbalance": imbalance}


def run(points: list[GridPoint]) -> list[dict]:
    """Measure and estimate every point on this rank; one row per point. A point routed unevenly (top-k below the
    experts) is estimated twice more: at the load the run had on this rank's most loaded expert, and the linear
    prediction of the measurement from the two estimates (:func:`at_measured_load`)."""
    rows = []
    for point in points:
        real = measured(point)
        row = {"point": point.name, "measured": real, "estimated": estimated(point)}
        if point.experts and point.topk < point.experts:
            row["estimated_at_max_load"] = estimated(point, max_load(point, real, row["estimated"]))
            row["expected"] = at_measured_load(real, row["estimated"], row["estimated_at_max_load"])
        rows.append(row)
    return rows


def tokens_per_layer(real: dict) -> dict[int, int]:
    """The tokens this rank's experts received in each MoE layer of the measured run."""
    from megatron_bridge_ext.estimate.trace import layer_of

    out: dict[int, int] = {}
    for name, tokens in real["expert_tokens"].items():
        out[layer_of(name)] = out.get(layer_of(name), 0) + tokens
    return out


def max_load(point: GridPoint, real: dict, balanced: dict) -> float:
    """The run's most loaded local expert over the balanced share the estimate states (its tokens per local expert)."""
    share = balanced["routed"] / (point.experts // point.ep)
    return max(real["expert_tokens"].values()) / share


def at_measured_load(real: dict, balanced: dict, loaded: dict) -> dict:
    """What the estimate predicts the run saved, from its balanced and its max-load traces: what an MoE layer saves
    (every category, the layer's bytes) is linear in the tokens its local experts receive, so each MoE layer saves
    the balanced bytes plus (its measured tokens - the balanced tokens) x the per-token bytes that the two traces
    differ by (their difference over their routed tokens' difference). Exact fractions; the measurement must be
    equal to the byte."""
    from fractions import Fraction

    tokens = tokens_per_layer(real)
    step = loaded["routed"] - balanced["routed"]
    excess = sum(t - balanced["routed"] for t in tokens.values())
    by_category = {c: balanced["by_category"][c] + Fraction(loaded["by_category"][c] - balanced["by_category"][c],
                                                             len(tokens) * step) * excess
                   for c in balanced["by_category"]}
    by_layer = {layer: b + (Fraction(loaded["by_layer"][layer] - b, step) * (tokens[layer] - balanced["routed"])
                            if layer in tokens else 0)
                for layer, b in balanced["by_layer"].items()}
    total = balanced["total"] + sum(by_layer.values()) - sum(balanced["by_layer"].values())
    return {"total": _exact(total), "by_category": {c: _exact(n) for c, n in by_category.items()},
            "by_layer": {layer: _exact(n) for layer, n in by_layer.items()}}


def _exact(value):
    """A whole number of bytes as an int (a fraction left over stays visible as a float, and differs)."""
    return int(value) if value.denominator == 1 else float(value)


def problems(rows: list[dict]) -> list[str]:
    """Every point whose estimate differs from the measurement: in total, in a category or in a layer. For a point
    routed unevenly, the estimate's prediction at the measured load must equal the measurement and the max-load
    estimate must bound it in total and per category."""
    out = []
    for row in rows:
        real, est = row["measured"], row.get("expected", row["estimated"])
        for view in ("total", "by_category", "by_layer"):
            if est[view] != real[view]:
                out.append(f"{row['point']} {view}: estimated {est[view]}, measured {real[view]}")
        if real["total"] == 0:
            out.append(f"{row['point']}: measured 0 B (a comparison of zeros proves nothing)")
        loaded = row.get("estimated_at_max_load")
        if loaded and (loaded["total"] < real["total"]
                       or any(loaded["by_category"][c] < n for c, n in real["by_category"].items())):
            out.append(f"{row['point']}: the max-load estimate {loaded['by_category']} is below the measurement "
                       f"{real['by_category']}")
        if loaded and loaded["routed"] <= row["estimated"]["routed"]:
            out.append(f"{row['point']}: the run's most loaded expert had no more than the balanced share")
    return out


def main() -> None:
    """Under torchrun with a world of ``--tp`` ranks: run that TP's points (``--moe``: the MoE points, on 2 ranks),
    all ranks' verdicts to ``--out``."""
    import torch.distributed as dist

    from megatron_bridge_ext.testing import distributed

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts points (MOE_GRID, 2 ranks)")
    args = parser.parse_args()
    distributed.init_from_env(tensor_parallel=args.tp)
    rows = run(MOE_GRID if args.moe else points_for(args.tp))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "rows": rows, "problems": problems(rows)})
    if dist.get_rank() == 0:
        with open(args.out, "w") as handle:
            json.dump(gathered, handle, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
