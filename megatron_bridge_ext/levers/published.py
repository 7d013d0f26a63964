"""NVIDIA's published throughput rows as the step time's inputs: each row's model shapes and layout as estimate
settings, and the model FLOPs per token Bridge publishes TFLOP/s/GPU with, so that predicted and published figures
compare.

The rows: ``tests/data/throughput/bridge_performance_summary.csv`` (Megatron Bridge's performance summaries, see
:mod:`.calibration`). A row is usable when its model's config.json is under ``tests/data`` and the step time models
its architecture and precision; every other row is skipped with its reason (:func:`skip_reason`).
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.estimate.settings import ReportSettings, Settings

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "data")
SUMMARY = os.path.join(DATA, "throughput", "bridge_performance_summary.csv")
CONFIGS = {"LLAMA3_8B": "llama-3-8b", "LLAMA3_70B": "llama-3-70b", "LLAMA3.1_405B": "llama-3.1-405b",
           "Qwen3_30B_a3B": "qwen3-30b-a3b", "Qwen3_235B_a22B": "qwen3-235b-a22b"}
"""Published model names by their config.json under tests/data (Hugging Face configs of the same models)."""
NOT_MODELLED = {
    "GPT OSS 120B": "sliding-window attention and attention sinks: the step time's core is full causal attention",
    "DeepSeekV3": "multi-latent attention and MTP layers are not built from config.json here",
    "Kimi_K2": "multi-latent attention is not built from config.json here",
    "DeepSeekV4 Flash": "sparse hybrid attention (dsv4_hybrid) is not in the step time",
    "Nemotron_3_Nano": "hybrid Mamba layer pattern is not built from config.json here",
    "Nemotron_3_Super": "hybrid Mamba layer pattern is not built from config.json here",
    "Nemotron_3_Ultra": "hybrid Mamba layer pattern is not built from config.json here",
    "Nemotron_3_5_Lightning": "no config.json under tests/data",
}
FP8_PRECISIONS = {"FP8", "FP8-CS", "FP8-MX", "MXFP8"}
GPU_PRESETS = {"DGX-H100": "h100", "DGX-B200": "b200", "DGX-B300": "b300", "DGX-GB200": "gb200", "DGX-GB300": "gb300"}
VOCAB_DIVISOR = 128
"""Megatron's ``make_vocab_size_divisible_by`` default: the output layer's vocabulary is padded to it times TP."""


@dataclass(frozen=True)
class Row:
    """One usable published row: its label, GPU preset, settings, MoE shape, FLOPs per step and published figure."""

    label: str
    gpu: str
    settings: Settings
    moe: Optional[dict]
    step_flops: float
    gpus: int
    published_tflops: float


def config(name: str) -> dict:
    with open(os.path.join(DATA, name, "config.json")) as f:
        return json.load(f)


def settings(c: dict, *, tp: int, pp: int, vpp: Optional[int], cp: int, dp: int, seq: int, mbs: int, gbs: int,
             fp8: bool, recompute: tuple[str, ...] = (), sp: Optional[bool] = None) -> Settings:
    """The estimate's settings the step time reads, from a Hugging Face config.json and a layout (SP and
    ``tp_comm_overlap`` with TP, as Bridge's performance recipes set them, unless ``sp`` says; distributed optimizer;
    the last stage holds ceil(layers / pp))."""
    heads = c["num_attention_heads"]
    return Settings(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, sequence_parallel=(tp > 1) if sp is None else sp and tp > 1,
                    seq_length=seq, micro_batch=mbs, num_microbatches=gbs // (mbs * dp), dtype="bfloat16",
                    fp8="hybrid" if fp8 else None, stage=pp - 1,
                    layers_on_stage=math.ceil(c["num_hidden_layers"] / pp), hidden=c["hidden_size"],
                    ffn=c["intermediate_size"], heads=heads, query_groups=c.get("num_key_value_heads") or heads,
                    kv_channels=c.get("head_dim") or c["hidden_size"] // heads, num_layers=c["num_hidden_layers"],
                    gated_linear_unit=True, vocab_size=c["vocab_size"],
                    recompute_granularity="selective" if recompute else None, recompute_modules=tuple(recompute),
                    attention="fused", transformer_impl="transformer_engine", device="cuda",
                    distributed_optimizer=True, peft=None, hybrid=None,
                    reports=ReportSettings(log_interval=1, train_iters=None, cuda_graph_first_iteration=None,
                                           wgrad_deferral_limit=None), moe=None, mla=None,
                    tp_comm_overlap=tp > 1 and (sp is None or sp))


def moe_shape(c: dict, ep: int, etp: int) -> Optional[dict]:
    """A Qwen3-MoE config.json's experts as :func:`.parallelism.cost.moe_shape` gives them (every layer MoE,
    no shared expert, the all-to-all dispatcher of Bridge's performance recipes)."""
    if not c.get("num_experts"):
        return None
    return {"experts": c["num_experts"], "topk": c["num_experts_per_tok"], "moe_ffn": c["moe_intermediate_size"],
            "shared_ffn": c.get("shared_expert_intermediate_size") or 0, "ep": ep, "etp": etp,
            "dispatcher": "alltoall", "grouped_gemm": True, "pattern": [1] * c["num_hidden_layers"]}


def flops_per_token(c: dict, seq: int, tp: int) -> float:
    """Model FLOPs per token as Bridge publishes them (flop_utils.py ``transformer_flops``, L753-1183, GQA without
    MLA or sliding windows): 3 x 2 x (the MLP's or experts' h x ffn x 3 per layer, QKV and projection, the causal
    core q x s, the output layer over the padded vocabulary)."""
    h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    q = (c.get("head_dim") or h // heads) * heads
    kv = (c.get("head_dim") or h // heads) * (c.get("num_key_value_heads") or heads)
    if c.get("num_experts"):
        mlp = c["moe_intermediate_size"] * c["num_experts_per_tok"] * 3 + (c.get("shared_expert_intermediate_size")
                                                                           or 0) * 3
    else:
        mlp = c["intermediate_size"] * 3
    divisor = VOCAB_DIVISOR * tp
    vocab = -(-c["vocab_size"] // divisor) * divisor
    return 6 * (h * mlp * layers + layers * (h * (q + 2 * kv) + q * h + q * seq) + h * vocab)


def _int(cell: str, default: int) -> int:
    return int(cell) if cell.strip() and cell.strip() != "n/a" else default


def skip_reason(r: dict) -> Optional[str]:
    """Why a published row is not compared, or None."""
    if "SUPERSEDED" in r["notes"]:
        return "superseded in its release"
    if r["model"] not in CONFIGS:
        return NOT_MODELLED.get(r["model"].split(" (")[0], "no config.json under tests/data") \
            if "(" not in r["model"] else "token-drop or MTP variant: routing or layers differ from the config"
    if r["precision"] == "NVFP4":
        return "NVFP4: the presets carry no FP4 rate"
    if not r["precision"]:
        return "precision not published (25.09 page)"
    if _int(r["other_settings"].split("fsdp=")[1].split(";")[0] if "fsdp=" in r["other_settings"] else "0", 0):
        return "Megatron FSDP: its per-layer parameter gathers are not modelled"
    if "phase=Pre-Training" not in r["other_settings"]:
        return "fine-tuning row: packed sequences, its FLOPs from the dataset's lengths"
    if r["recompute"]:
        return "recompute settings not modelled from the summary's wording"
    return None


def rows(path: str = SUMMARY) -> tuple[list[Row], list[tuple[dict, str]]]:
    """(usable rows, skipped rows with their reasons) of the published summary."""
    usable, skipped = [], []
    with open(path) as f:
        for r in csv.DictReader(f):
            reason = skip_reason(r)
            if reason:
                skipped.append((r, reason))
                continue
            usable.append(_row(r))
    return usable, skipped


def _row(r: dict) -> Row:
    c = config(CONFIGS[r["model"]])
    tp, pp, cp, gpus = _int(r["tp"], 1), _int(r["pp"], 1), _int(r["cp"], 1), int(r["num_gpus"])
    vp = _int(r["vp"], 1)
    ep, etp = _int(r["ep"], 1), _int(r["etp"], 1)
    dp, seq, mbs, gbs = gpus // (tp * pp * cp), int(r["seq"]), int(r["mbs"]), int(r["gbs"])
    s = settings(c, tp=tp, pp=pp, vpp=vp if vp > 1 else None, cp=cp, dp=dp, seq=seq, mbs=mbs, gbs=gbs,
                 fp8=r["precision"] in FP8_PRECISIONS)
    label = (f"{r['version_or_date'].replace('NeMo container ', '')} {r['model']} {gpus}x{r['gpu']} {r['precision']} "
             f"TP{tp} PP{pp} VP{vp} CP{cp} EP{ep} DP{dp} mbs{mbs} gbs{gbs} seq{seq}")
    return Row(label, GPU_PRESETS[r["gpu"]], s, moe_shape(c, ep, etp), flops_per_token(c, seq, tp) * gbs * seq, gpus,
               float(r["tflops_per_gpu"]))
