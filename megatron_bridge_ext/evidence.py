"""Published measurements the package cites when it explains a choice, each with its source.

One place for the figures used by the allocator guards, the OOM diagnosis and the planner, so
that they cannot drift apart. None of them is measured by this package; each says where it comes
from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Evidence:
    figure: str
    source: str

    def __str__(self) -> str:
        return f"{self.figure} ({self.source})"


MEMORY_TUNING_DOC = ("Megatron Bridge documentation, Memory Tuning (docs.nvidia.com/nemo/megatron-bridge, "
                     "skills/nemo-mbridge-perf-memory-tuning)")
LLAMA3_70B_SFT = f"Llama3 70B SFT, 32x H100, TP4 PP4 VPP5 DP2; {MEMORY_TUNING_DOC}"

FRAGMENTATION_FIX = Evidence(
    "a run at 58.8 GB peak went out of memory from fragmentation; expandable segments fixed it with no "
    "throughput change", LLAMA3_70B_SFT)
PP_DOUBLING = Evidence("PP 4->8: -5.9% throughput", LLAMA3_70B_SFT)
TP_DOUBLING = Evidence("TP 4->8: -28.4% throughput", LLAMA3_70B_SFT)
MLP_RECOMPUTE = Evidence("selective `mlp` recompute: about -16% throughput for about 3 GB", LLAMA3_70B_SFT)
MOE_README = ("Megatron Core MoE README, Performance Best Practice, Tuning Guide of Parallel Mappings "
              "(github.com/NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md)")
EP_OVER_TP = Evidence(
    "prefer EP over TP for the expert layer: TP saves more memory, EP has better GEMM efficiency and less "
    "communication; EP8TP1 beats EP4TP2 on Mixtral 8x7B; per-layer communication TP high, EP and PP medium",
    MOE_README)
CORE_ATTN_FUSED = Evidence(
    "core_attn recompute with fused attention: -0.01% memory for +3.85% step time", "Megatron Bridge, Moonlight 16B")
QWEN3_8B_REGATHER = Evidence(
    "LoRA SFT peak 47.545 GB -> 42.814 GB (-10.0%) for -6.74% throughput with sequence_parallel_input_regather",
    "Megatron Bridge, Qwen3-8B TP2 sequence 8192, H100, SQuAD")

MOE_REGATHER_SOURCE = ("Megatron Bridge, Memory Tuning, LoRA + SP input re-gather: real-checkpoint H100 training on "
                       "SQuAD (Qwen3-30B-A3B TP4/EP4: -2.89% throughput; GPT-OSS-120B TP2/EP8: -0.34%)")

COST_WITHOUT_EXPANDABLE = (
    f"without expandable segments the caching allocator fragments: {FRAGMENTATION_FIX}; the alternatives "
    f"cost throughput ({PP_DOUBLING.figure}, {TP_DOUBLING.figure}, {MLP_RECOMPUTE.figure})"
)

LLAMA3_70B = "Llama3 70B SFT, 32x H100"

LEVERS: tuple[dict[str, str | int], ...] = (
    {"step": 1, "name": "allocator",
     "action": "turn on expandable segments: megatron_bridge_ext.init() first in the training script, "
               "megatron_bridge_ext.levers.allocator.apply.configure_bridge_env(cfg) in a Bridge recipe, "
               "or `mbx run -- torchrun ...`",
     "cost": f"none: fixed a fragmentation OOM at 58.8 GB peak with no throughput change ({LLAMA3_70B})",
     "source": MEMORY_TUNING_DOC},
    {"step": 2, "name": "LoRA input under sequence parallelism",
     "action": 'megatron_bridge_ext.peft.LoRA(sequence_parallel_input_strategy="shard_local"): LoRA-A works on '
               "the local sequence shard instead of saving a gathered copy of its input",
     "cost": "LoRA with sequence parallelism only; no collective on the s*b*h input; `mbx bench memory` "
             "measures the saving",
     "source": ""},
    {"step": 3, "name": "selective recompute",
     "action": "recompute_granularity='selective' with recompute_modules, cheapest modules first",
     "cost": f"`mlp` recompute: about -16% throughput for about 3 GB ({LLAMA3_70B})",
     "source": MEMORY_TUNING_DOC},
    {"step": 4, "name": "parallelism",
     "action": "raise EP (mixture of experts: the same GPUs, the dense DP kept), raise PP at the cost of DP, raise "
               "the expert TP (mixture of experts), or double TP",
     "cost": f"PP 4->8: -5.9% throughput; TP 4->8: -28.4% ({LLAMA3_70B}); EP over TP for the expert layer "
             "(Megatron Core's MoE guide)",
     "source": MEMORY_TUNING_DOC},
    {"step": 5, "name": "CPU offloading",
     "action": "cpu_offloading=True (activations and weights of some layers to host memory)",
     "cost": "only possible with PP = 1 (and without recompute, in Megatron Core)",
     "source": ""},
)
"""The levers against an OOM in the order to try them, cheapest first, each with its published cost."""


LORA_RUNS = "runs that train LoRA adapters with sequence parallelism"
"""Where step 2 acts: without LoRA (full fine-tuning, pretraining, a Megatron-LM run) or without SP there is no LoRA-A
input to keep as a shard."""


def after_allocator() -> dict:
    """The next lever once memory, not fragmentation, is the problem: step 2 for the runs it applies to, and step 3
    (``otherwise``) for every other run, since a log or a stats dump does not say whether the run trains LoRA."""
    return {**LEVERS[1], "applies_to": LORA_RUNS, "otherwise": dict(LEVERS[2])}


def step_text(step: dict) -> str:
    """A next step as one phrase: its action, and what to do instead where it applies to some runs only."""
    text = step["action"]
    if step.get("applies_to"):
        other = step["otherwise"]
        text = (f"for {step['applies_to']}: {text}; otherwise (full fine-tuning, pretraining, no SP) step "
                f"{other['step']}, {other['name']}: {other['action']}")
    return text


def sources(levers=LEVERS) -> list[str]:
    """The distinct sources of the levers' figures, in order."""
    return list(dict.fromkeys(str(lever["source"]) for lever in levers if lever["source"]))
