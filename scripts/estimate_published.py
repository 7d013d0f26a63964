"""The memory estimate, and Bridge's own, against Megatron Bridge's published peaks: LoRA and the memory levers.

    python scripts/estimate_published.py [--lever lora|optimizer-offload|cuda-graphs|recompute|all]
        [--model qwen3-8b|qwen3-30b-a3b|gpt-oss-120b] [--hf-config FILE] [--json FILE]

``--lever lora`` (the default) compares the LoRA peaks of ``--model``; the other levers are the cases of
:data:`LEVERS` below (their sources, workloads and what the sources do not state are written there and printed);
``--lever all`` runs the LoRA of every model and every lever.

LoRA, published (Megatron Bridge, Memory Tuning skill, "LoRA + SP input re-gather"; real-checkpoint H100
training on SQuAD; ``skills/nemo-mbridge-perf-memory-tuning/SKILL.md`` in NVIDIA-NeMo/Megatron-Bridge):

* Qwen3-8B, TP2, sequence 8192: peak 47.545 GB with Bridge's LoRA, 42.814 GB with its
  ``sequence_parallel_input_regather``;
* Qwen3-30B-A3B, TP4/EP4: 29.890 GB and 28.321 GB;
* GPT-OSS-120B, TP2/EP8: 52.185 GB and 51.371 GB.

Bridge reports ``torch.cuda.memory_stats()`` peaks in GB of 10^9 bytes (``report_memory``). What the
publication does not state is assumed here, and printed: the LoRA of Bridge's PEFT recipe for the
model (Qwen3-8B and GPT-OSS-120B: Bridge's default, rank 32 on the four linear layers, and for Qwen3-8B
the 72 eligible adapters match the published saving; Qwen3-30B-A3B: rank 8, alpha 16 on ``linear_qkv``
and ``linear_proj``, as ``qwen3_30b_a3b_peft_4gpu_h100_bf16_config`` sets it), sequence 8192 for
the MoE models too (their sequence is not stated), micro-batch 1, the smallest DP of 4 or more that
Megatron Core's expert layout allows, the distributed optimizer and bf16 mixed precision of Bridge's
recipes, no recompute, Transformer Engine with fused attention, a balanced expert load, and the
provider Bridge builds from the model's config.json. For the MoE models a third row gives our
``shard_local`` strategy (nothing published).

The levers' cases are built as ``mbx plan --recipe ... --hf-config ...`` builds them (``configs.build``: the
recipe the publication ran, the layout it states, its lever as an override); Bridge's estimate is not shown for
them (it models none of these levers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 8192
BASELINE, REGATHER, SHARD_LOCAL = "Bridge's LoRA", "Bridge's LoRA with sequence_parallel_input_regather", \
    "our LoRA with sequence_parallel_input_strategy=shard_local"
MODELS = {
    "qwen3-8b": {"title": "Qwen3-8B", "tp": 2, "ep": 1, "dp": 4,
                 "published": {BASELINE: 47.545e9, REGATHER: 42.814e9}},
    "qwen3-30b-a3b": {"title": "Qwen3-30B-A3B", "tp": 4, "ep": 4, "dp": 4,
                      "lora": {"target_modules": ["linear_qkv", "linear_proj"], "dim": 8, "alpha": 16},
                      "published": {BASELINE: 29.890e9, REGATHER: 28.321e9, SHARD_LOCAL: None}},
    "gpt-oss-120b": {"title": "GPT-OSS-120B", "tp": 2, "ep": 8, "dp": 4,
                     "published": {BASELINE: 52.185e9, REGATHER: 51.371e9, SHARD_LOCAL: None}},
}
"""Published peaks (None: not published), the layout and the recipe's LoRA fields (Bridge's defaults where absent)
of each case; DP is the assumption described above."""


BRIDGE = "NVIDIA-NeMo/Megatron-Bridge@067f987df03b8355b03192d88d70f1709fedf51a"
"""The snapshot of Bridge's repository the levers' figures and line numbers were read from."""
RECIPES = "megatron.bridge.recipes."
QWEN3_30B = RECIPES + "qwen.h100.qwen3_moe:qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config"
GRAPHS_ON = ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=null",
             "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]",
             "model.use_te_rng_tracker=True", "rng.te_rng_tracker=True"]
NO_RECOMPUTE = ["model.recompute_granularity=null", "model.recompute_method=null", "model.recompute_num_layers=null"]


class Case(NamedTuple):
    """One published measurement: its label, its figure in bytes (None where the source states none for it),
    the source's words for it, and the overrides that turn the lever's workload into it."""

    label: str
    published: Optional[float]
    stated: str
    overrides: tuple[str, ...] = ()


class Lever(NamedTuple):
    """A lever's published cases on one workload: the recipe the publication ran, its layout, where it was
    published and what it did not state (assumed here and printed)."""

    title: str
    source: str
    workload: str
    recipe: str
    hf_config: str
    layout: dict
    overrides: tuple[str, ...]
    assumed: str
    cases: tuple[Case, ...]


def _offload(fraction: float, allocated: float, saved: float, job: str) -> Case:
    return Case(f"optimizer offload fraction {fraction:g}", allocated, f"mem_allocated_gb: {allocated / 1e9:g}, "
                f"mem_saved_gb: {saved / 1e9:g} (job {job})",
                ("optimizer.optimizer_cpu_offload=True", f"optimizer.optimizer_offload_fraction={fraction:g}"))


def _modules(modules: list[str], published: Optional[float], stated: str) -> Case:
    label = f"recompute_modules [{', '.join(modules)}]"
    return Case(label, published, stated, ("model.recompute_granularity=selective",
                                           f"model.recompute_modules=[{','.join(modules)}]"))


LEVERS = {
    "optimizer-offload": [Lever(
        "Qwen3-30B-A3B pretraining, optimizer CPU offload by fraction",
        f"{BRIDGE} skills/nemo-mbridge-perf-cpu-offloading/card.yaml L122-172 (measured_results, validated "
        "2026-03-30); docs/training/cpu-offloading.md L43 (\"3.8 GB saved per 25% of optimizer offload fraction "
        "(up to 15.3 GB / 32% at 100%)\", \"47.2 GB baseline\")",
        "qwen3_30b_a3b_pretrain_config, TP2 PP2 EP4, 2 nodes of H100 (16 GPUs, DP 4), micro-batch 1, global "
        "batch 8 (the skill's command), 20 iterations; GB as mem_allocated_gb",
        QWEN3_30B, "qwen3-30b-a3b", dict(tp=2, pp=2, ep=4, gpus=16, micro_batch=1, global_batch=8), (),
        "the recipe's sequence 4096, bf16 and full recompute (uniform, 1 layer), its DeepEP dispatcher, "
        "overlap_cpu_optimizer_d2h_h2d off; mem_allocated_gb read as the peak allocated in 10^9 bytes",
        (Case("no offload (baseline)", 47.2e9, "mem_allocated_gb: 47.2 (job 10119286)"),
         _offload(0.25, 43.4e9, 3.8e9, "10611042"), _offload(0.5, 39.6e9, 7.6e9, "10611043"),
         _offload(0.75, 35.6e9, 11.6e9, "10611045"), _offload(1.0, 32.0e9, 15.3e9, "10609512")))],
    "cuda-graphs": [Lever(
        "Qwen3-30B-A3B pretraining, Transformer Engine CUDA graphs off and on",
        f"{BRIDGE} skills/nemo-mbridge-perf-cuda-graphs/card.yaml L67-74 (memory: \"No extra memory was observed in "
        "the pre-capture reports\"), L166-182 (the run); docs/performance-guide.md L301 (\"typically adding a few "
        "gigabytes for static buffers, while models with PP size > 1 may consume over 10GB\")",
        "Qwen3-30B-A3B pretrain, TP2 PP2 EP4, 2 nodes of H100 80GB (16 GPUs, DP 4), scope "
        "attn+moe_router+moe_preprocess, impl transformer_engine",
        QWEN3_30B, "qwen3-30b-a3b", dict(tp=2, pp=2, ep=4, gpus=16, micro_batch=1), tuple(NO_RECOMPUTE),
        "the recipe's sequence 4096, micro-batch 1, bf16, its DeepEP dispatcher; no recompute (Core refuses the "
        "recipe's full recompute with TE-scoped graphs); the TE RNG tracker on (graphs require it)",
        (Case("CUDA graphs off", None, "no figure published"),
         Case("CUDA graphs on", None, "no extra memory observed in the pre-capture reports; no figure",
              tuple(GRAPHS_ON)))),
        Lever(
        "GPT-OSS-120B pretraining, Transformer Engine CUDA graphs off and on",
        f"{BRIDGE} skills/nemo-mbridge-perf-cuda-graphs/card.yaml L222-233 (status blocked: \"OOM on iteration 2 "
        "while allocating 1.54 GiB\", memory_at_iter1_allocated_gb \"69-70\", memory_at_iter1_reserved_gb "
        "\"72-73\"), L71-74 (\"with roughly 69-70 GB already allocated on 79 GB H100s\")",
        "GPT-OSS-120B pretrain, TP2 PP4 EP8 CP1, 4 nodes of H100 80GB (32 GPUs, DP 4), scope "
        "attn+moe_router+moe_preprocess, impl transformer_engine",
        RECIPES + "gpt_oss.h100.gpt_oss:gpt_oss_120b_pretrain_64gpu_h100_bf16_config", "gpt-oss-120b",
        dict(tp=2, pp=4, ep=8, gpus=32), (),
        "the recipe's sequence 4096, micro-batch 1, bf16, no recompute, its DeepEP dispatcher; the TE RNG tracker on "
        "(graphs require it); the published 69-70 GB is a range at iteration 1, not a peak, so no difference is taken",
        (Case("CUDA graphs off", None, "not run"),
         Case("CUDA graphs on", None, "69-70 GB allocated, 72-73 GB reserved at iteration 1; OOM on iteration 2 "
              "allocating 1.54 GiB", tuple(GRAPHS_ON))))],
    "recompute": [Lever(
        "Moonlight 16B pretraining, selective recompute sets",
        f"{BRIDGE} skills/nemo-mbridge-perf-activation-recompute/SKILL.md L105-126 (\"Matched H100 Evidence: "
        "Moonlight 16B\", Bridge 600d069b, Core 24bad8e6); skills/nemo-mbridge-perf-activation-recompute/card.yaml "
        "L137-184 (peak_mem_gb)",
        "Moonlight 16B BF16 pretraining recipe, 8 H100 80GB, sequence 4096, MBS 1, GBS 4, TP2 PP1 CP1 EP8, mock "
        "data, 20 steps; peak allocated = the maximum post-optimizer value reported after iteration 2",
        RECIPES + "moonlight.h100.moonlight_16b:moonlight_16b_pretrain_8gpu_h100_bf16_config", "moonlight-16b-a3b",
        dict(gpus=8, seq=4096, micro_batch=1, global_batch=4), (),
        "the recipe's dispatcher (DeepEP), TE fused attention, the distributed optimizer; GB = 10^9 bytes",
        (_modules([], 36.618e9, "36.618 GB (control)"), _modules(["core_attn"], 36.614e9, "36.614 GB (-0.01%)"),
         _modules(["mla_up_proj"], 35.902e9, "35.902 GB (-1.96%)"),
         _modules(["mla_up_proj", "mlp"], 35.917e9, "35.917 GB (-1.91%)"),
         _modules(["moe_act"], 35.941e9, "35.941 GB (-1.85%)"),
         _modules(["layernorm", "moe_act"], 35.949e9, "35.949 GB (-1.83%)"))),
        Lever(
        "Nemotron 3 Nano pretraining, selective recompute sets",
        f"{BRIDGE} skills/nemo-mbridge-perf-activation-recompute/SKILL.md L139-154 (\"Matched H100 Evidence: "
        "Nemotron 3 Nano\"); card.yaml L193-234 (peak_mem_gb_after_iteration_1 of [] and moe_act, peak_mem_gb of moe "
        "and moe, layernorm)",
        "native 16-H100 BF16 performance recipe, sequence 8192, MBS 1, GBS 16, TP1 PP1 CP1 EP8, DP16, expert-DP 2, "
        "HybridEP, grouped GEMM, TE CUDA graphs for attention and Mamba, mock data, 12 steps; rank-0 measured peak",
        RECIPES + "nemotronh.h100.nemotron_3_nano:nemotron_3_nano_pretrain_8gpu_h100_bf16_config",
        "nemotron-3-nano-30b-a3b", dict(gpus=16, seq=8192, micro_batch=1, global_batch=16), (),
        "the 8-GPU H100 recipe laid out on 16 GPUs (the 16-GPU performance recipe is not in Bridge 0.6.2); GB = "
        "10^9 bytes; the published peaks after iteration 1 are of runs that then ran out of memory",
        (_modules([], 66.297e9, "OOM after iteration 1; 66.297 GB after iteration 1"),
         _modules(["core_attn"], None, "OOM in iteration 1; not comparable"),
         _modules(["moe_act"], 62.103e9, "OOM after iteration 1; 62.103 GB after iteration 1"),
         _modules(["layernorm", "moe_act"], None, "OOM in iteration 1; not comparable"),
         _modules(["moe"], 64.653e9, "completed 12 steps; 64.653 GB after iteration 2"),
         _modules(["moe", "layernorm"], 63.639e9, "completed 12 steps; 63.639 GB after iteration 2")))],
}
"""The levers' published cases; each lever's first case is the reference its changes are measured from."""
CHOICES = ["lora", *LEVERS, "all"]


def selected(lever: str, model: str) -> list[tuple[str, str]]:
    """What ``--lever`` runs, in order: ("lora", model) for the LoRA comparison of a model, (lever, "") for a lever's
    cases; ``all`` runs the LoRA of every model, then every lever."""
    if lever == "all":
        return [("lora", name) for name in MODELS] + [(name, "") for name in LEVERS]
    if lever == "lora":
        return [("lora", model)]
    if lever not in LEVERS:
        raise ValueError(f"unknown lever {lever!r}: one of {', '.join(CHOICES)}")
    return [(lever, "")]


def _config(path: str, model: dict, case: str):
    from megatron_bridge_ext.estimate import configs
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    from megatron.bridge.peft.lora import LoRA

    layout = configs.Layout(tp=model["tp"], ep=model["ep"], seq=SEQ, dp=model["dp"], micro_batch=1)
    cfg = configs.from_hf_config(path, layout)
    if case == SHARD_LOCAL:
        from megatron_bridge_ext.peft import LoRA as OurLoRA

        cfg.peft = OurLoRA(sequence_parallel_input_strategy="shard_local", **model.get("lora", {}))
    else:
        cfg.peft = LoRA(sequence_parallel_input_regather=case == REGATHER, **model.get("lora", {}))
    return cfg


def _gb_or_dash(nbytes) -> str:
    return "-" if nbytes is None else _gb(nbytes)


def _diff_or_dash(value, reference) -> str:
    return "-" if reference is None else _diff(value, reference)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def _diff(value: float, reference: float) -> str:
    return f"{(value - reference) / 1e9:+.3f} GB ({(value - reference) / reference:+.1%})"


def _lora(name: str, hf_config: Optional[str]) -> list[dict]:
    """The LoRA comparison of model ``name``: prints its tables, returns its records."""
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.bridge import bridge_estimate
    from megatron_bridge_ext.table import text_table

    model = MODELS[name]
    path = hf_config or os.path.join(ROOT, "tests", "data", name, "config.json")
    rows, records, first = [], [], None
    for label, published in model["published"].items():
        cfg = _config(path, model, label)
        start = time.perf_counter()
        ours = estimate(cfg)
        seconds = time.perf_counter() - start
        bridge = bridge_estimate(cfg, data_parallel_size=model["dp"])
        first = first or ours
        rows.append([label, _gb_or_dash(published), _gb(ours.peak_bytes), _diff_or_dash(ours.peak_bytes, published),
                     _gb(bridge.total_bytes), _diff_or_dash(bridge.total_bytes, published)])
        records.append({"case": label, "published_bytes": published, "estimate_bytes": ours.peak_bytes,
                        "bridge_estimate_bytes": bridge.total_bytes, "estimate_seconds": seconds,
                        "estimate": ours.as_dict(), "bridge_estimate": bridge.as_dict()})
    saving = [records[0][k] - records[1][k] for k in ("published_bytes", "estimate_bytes", "bridge_estimate_bytes")]
    rows.append(["saving (first - second)", _gb(saving[0]), _gb(saving[1]), _diff(saving[1], saving[0]),
                 _gb(saving[2]), _diff(saving[2], saving[0])])
    s = first.settings
    experts = f" EP={model['ep']}" if model["ep"] > 1 else ""
    print(f"{model['title']} LoRA, published peaks (Megatron Bridge, H100, SQuAD) against the estimates; GB = 10^9 "
          f"bytes\nsettings the estimate assumed: TP={s.tp}{experts} SP={'on' if s.sequence_parallel else 'off'} "
          f"PP={s.pp} "
          f"DP={s.dp}, seq {s.seq_length}, micro-batch {s.micro_batch}, {s.dtype}, LoRA r={s.peft.lora_dim} on "
          f"{', '.join(s.peft.lora_targets)}, recompute {s.recompute_granularity or 'none'}, attention "
          f"{s.attention}, {s.transformer_impl}, distributed optimizer "
          f"{'on' if s.distributed_optimizer else 'off'}\n")
    print(text_table(["case", "published peak", "estimate", "estimate - published", "Bridge's estimate",
                      "Bridge - published"], rows))
    print(f"\nestimate seconds: {', '.join(f'{r['estimate_seconds']:.1f}' for r in records)} ({os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}: the machine is shared)")
    for record, label in zip(records, model["published"]):
        est = record["estimate"]
        print(f"\n{label}: components of the estimate (GiB = 2^30 bytes)")
        print(text_table(["kind", "component", "bytes"],
                         [[c["kind"], c["name"], f"{c['bytes'] / 2**30:,.2f} GiB"] for c in est["components"]]))
    print("\nassumptions of the estimate:")
    print("\n".join(f"  - {a}" for a in first.assumptions))
    print("Bridge's estimate_training_memory assumptions:")
    print("\n".join(f"  - {a}" for a in records[0]["bridge_estimate"]["assumptions"]))
    return records




def _lever_case(lever: Lever, case: Case) -> dict:
    """Our estimate of one published case, built as ``mbx plan`` builds its recipe and overrides."""
    from megatron_bridge_ext.estimate import configs, estimate
    from megatron_bridge_ext.findings import Refused

    overrides = [*lever.overrides, *case.overrides]
    record = {"lever": lever.title, "case": case.label, "published_bytes": case.published, "stated": case.stated,
              "overrides": overrides, "estimate_bytes": None}
    try:
        built = configs.build(configs.Layout(**lever.layout), overrides, recipe=lever.recipe,
                              hf_config=os.path.join(ROOT, "tests", "data", lever.hf_config, "config.json"))
        start = time.perf_counter()
        ours = estimate(built.cfg)
    except Refused as refused:
        return {**record, "refused": refused.one_line()}
    return {**record, "estimate_bytes": ours.peak_bytes, "peak_phase": ours.peak_phase.name,
            "steady_bytes": ours.steady_peak_bytes, "phase_peaks": {p.name: p.peak_bytes for p in ours.phases},
            "estimate_seconds": time.perf_counter() - start, "notes": built.notes, "settings": ours.settings,
            "estimate": ours.as_dict()}


def _change(record: dict, first: dict, key: str) -> str:
    """``record``'s ``key`` less the lever's first case's, '-' where either is missing."""
    if record is first or record.get(key) is None or first.get(key) is None:
        return "-"
    return f"{(record[key] - first[key]) / 1e9:+.3f} GB"


def _lever_row(record: dict, first: dict) -> list[str]:
    published, ours = record["published_bytes"], record["estimate_bytes"]
    if ours is None:
        return [record["case"], record["stated"], "refused", "-", _change(record, first, "published_bytes"),
                "-", "-", "-"]
    return [record["case"], record["stated"], f"{_gb(ours)} ({record['peak_phase']})",
            _diff_or_dash(ours, published), _change(record, first, "published_bytes"),
            _change(record, first, "estimate_bytes"), _gb(record["steady_bytes"]),
            _change(record, first, "steady_bytes")]


def _lever(lever: Lever) -> list[dict]:
    """The comparison of one lever's published cases: prints its tables, returns its records."""
    from megatron_bridge_ext.table import text_table

    records = [_lever_case(lever, case) for case in lever.cases]
    first = records[0]
    print(f"{lever.title}; GB = 10^9 bytes\nsource: {lever.source}\npublished workload: {lever.workload}\n"
          f"assumed (not stated by the source): {lever.assumed}\nrecipe: {lever.recipe}, --hf-config "
          f"tests/data/{lever.hf_config}/config.json, layout {lever.layout}, overrides "
          f"{' '.join(lever.overrides) or 'none'} (each case adds its own)\n")
    print(text_table(["case", "published", "estimate (peak phase)", "estimate - published",
                      "published change", "estimate change", "estimate steady state", "steady-state change"],
                     [_lever_row(r, first) for r in records]))
    for record in records:
        if "refused" in record:
            print(f"\n{record['case']}: refused: {record['refused']}")
    done = [r for r in records if r["estimate_bytes"] is not None]
    if done:
        _print_details(done)
    print()
    return [_lever_record(r) for r in records]


def _print_details(done: list[dict]) -> None:
    """Each estimated case's phases, the settings the estimate assumed and each case's new assumptions."""
    s = done[0]["settings"]
    print("\nthe estimate's phases (peak of each; the whole-run peak is the largest):")
    for record in done:
        print(f"  {record['case']}: " + ", ".join(f"{n} {_gb(b)}" for n, b in record["phase_peaks"].items()))
    print(f"\nsettings the estimate assumed: TP={s.tp} PP={s.pp} DP={s.dp} "
          f"SP={'on' if s.sequence_parallel else 'off'}, "
          f"seq {s.seq_length}, micro-batch {s.micro_batch}, {s.dtype}, attention {s.attention}, "
          f"{s.transformer_impl}, distributed optimizer {'on' if s.distributed_optimizer else 'off'}; "
          f"build notes: {'; '.join(done[0]['notes']) or 'none'}")
    print(f"estimate seconds: {', '.join(f'{r['estimate_seconds']:.1f}' for r in done)} ({os.cpu_count()} CPU "
          f"cores, load average {os.getloadavg()[0]:.1f}: the machine is shared)")
    seen = set()
    print("assumptions of the estimate:")
    for record in done:
        fresh = [a for a in record["estimate"]["assumptions"] if a not in seen]
        seen.update(fresh)
        if fresh:
            print(f"  {record['case']}:" + "".join(f"\n  - {a}" for a in fresh))


def _lever_record(record: dict) -> dict:
    """What the JSON keeps of a case: the figures, the phases, the components and the assumptions."""
    kept = {k: v for k, v in record.items() if k not in ("settings", "estimate")}
    if "estimate" in record:
        kept["components"] = [{k: c[k] for k in ("kind", "name", "bytes")} for c in record["estimate"]["components"]]
        kept["assumptions"] = record["estimate"]["assumptions"]
    return kept


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_bridge_ext import logs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lever", choices=CHOICES, default="lora", help="what to compare (default: lora)")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b", help="the LoRA model")
    parser.add_argument("--hf-config", default=None, help="the LoRA model's; default: tests/data/<model>/config.json")
    parser.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    logs.configure()
    records = []
    for kind, name in selected(args.lever, args.model):
        if kind == "lora":
            records += _lora(name, args.hf_config if args.lever == "lora" else None)
        else:
            records += [r for lever in LEVERS[kind] for r in _lever(lever)]
        print()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
