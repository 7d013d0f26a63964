"""The memory estimate, and Bridge's own, against Megatron Bridge's published LoRA peaks.

    python scripts/estimate_published.py [--model qwen3-8b|qwen3-30b-a3b|gpt-oss-120b] [--hf-config FILE] [--json FILE]

Published (Megatron Bridge, Memory Tuning skill, "LoRA + SP input re-gather"; real-checkpoint H100
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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

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


def main() -> int:
    from megatron_bridge_ext import logs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    parser.add_argument("--hf-config", default=None, help="default: tests/data/<model>/config.json")
    parser.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    args = parser.parse_args()
    logs.configure()
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.estimate.bridge import bridge_estimate
    from megatron_bridge_ext.table import text_table

    model = MODELS[args.model]
    path = args.hf_config or os.path.join(ROOT, "tests", "data", args.model, "config.json")
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
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
