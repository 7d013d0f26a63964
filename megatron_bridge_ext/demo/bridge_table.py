"""The tables of ``mbx demo --bridge``, and how far two runs' printed figures may differ between CPUs.

A run's row per variant (:func:`row`), its tables (:func:`format_tables`), printed with the decimals the
rounding bounds support (:func:`rounding_bounds`, :func:`decimals`); :func:`compare_runs` says whether two
runs differ beyond rounding.
"""

from __future__ import annotations

from megatron_bridge_ext.testing.bridge.recipe import (
    FFN, GLOBAL_BATCH, HEADS, HIDDEN, LAYERS, LORA_RANK, SEQ, TENSOR_PARALLEL, VOCAB)
from megatron_bridge_ext.testing.bridge.runner import Run

FP32_UNIT_ROUNDOFF = 2.0 ** -24


def _gamma(terms: int) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative change of a sum of n fp32 terms of one sign when its
    order changes (Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1 and section 4.2)."""
    return terms * FP32_UNIT_ROUNDOFF / (1 - terms * FP32_UNIT_ROUNDOFF)


def rounding_bounds() -> dict[str, float]:
    """Relative bounds on how much the printed loss and grad norm may differ between CPUs (their BLAS and SIMD
    kernels sum in other orders), to first order: gamma of the terms summed along the longest chain behind the figure.

    Loss: per layer the norm (h), linear_qkv (h), the scores (h / heads), attention x V (s), linear_proj (h/t,
    then t ranks), linear_fc1 (h), linear_fc2 (ffn/t, then t); then the output layer (h), the log-sum-exp over
    the vocabulary (V/t, then t) and the mean over the step's tokens. Grad norm: the backward chain (twice the
    forward one) and its sum of squares over the trainable parameters of both ranks (LoRA A [r, in] and
    B [out, r] of the four targets, split as Megatron splits them). Earlier iterations enter a figure only
    through weight updates scaled by the learning rate, which leaves these bounds unchanged to first order.
    """
    h, t, r = HIDDEN, TENSOR_PARALLEL, LORA_RANK
    per_layer = h + h + h // HEADS + SEQ + (h // t + t) + h + (FFN // t + t)
    forward = LAYERS * per_layer + h + (VOCAB // t + t) + SEQ * GLOBAL_BATCH
    lora = (r * h + 3 * h // t * r) + (r * h // t + h * r) + (r * h + FFN // t * r) + (r * FFN // t + h * r)
    return {"loss": _gamma(forward), "grad_norm": _gamma(2 * forward + t * LAYERS * lora)}


FLOAT_FIGURES = {"losses": "loss", "grad_norms": "grad_norm"}
"""The row fields that depend on the CPU's floating-point kernels, and their bound in :func:`rounding_bounds`."""


def compare_runs(rows: list[dict], reference: list[dict]) -> list[str]:
    """How two runs' rows differ beyond rounding: every exact field (variant, bytes, counts, environment) must be
    equal; losses and grad norms within twice their bound of each other (each is within it of the exact value)."""
    bounds = rounding_bounds()
    problems = []
    if [r["variant"] for r in rows] != [r["variant"] for r in reference]:
        return [f"variants {[r['variant'] for r in rows]} != {[r['variant'] for r in reference]}"]
    for row, ref in zip(rows, reference):
        exact = sorted((set(row) | set(ref)) - set(FLOAT_FIGURES))
        problems += [f"{row['variant']}: {k} {row.get(k)!r} != {ref.get(k)!r}" for k in exact
                     if row.get(k) != ref.get(k)]
        for field, name in FLOAT_FIGURES.items():
            if len(row[field]) != len(ref[field]):
                problems.append(f"{row['variant']}: {len(row[field])} {field} != {len(ref[field])}")
            for i, (a, b) in enumerate(zip(row[field], ref[field]), start=1):
                if a is None or b is None:  # no grad norm reported that iteration: both runs must agree
                    if a is not b:
                        problems.append(f"{row['variant']}: iteration {i} {name} {a!r} vs {b!r}")
                    continue
                allowed = 2 * bounds[name] * max(abs(a), abs(b))
                if abs(a - b) > allowed:
                    problems.append(f"{row['variant']}: iteration {i} {name} {a!r} vs {b!r} differ by "
                                    f"{abs(a - b):.3g} > {allowed:.3g}")
    return problems


def decimals(bound: float, values) -> int:
    """The most decimals whose last digit the bound still supports: 10**-d >= bound * max |value|."""
    import math

    largest = max((abs(v) for v in values if v is not None), default=1.0)
    return max(0, math.floor(-math.log10(bound * largest)))


def row(name: str, result: Run) -> dict:
    """The row of one fine-tuned variant: losses, grad norms and the last micro-batch's saved bytes."""
    last = result.saved[-1]
    lora_inputs = {k: v for k, v in last.by_module.items() if last.module_categories.get(k) == "lora_input"}
    return {
        "variant": name,
        "losses": result.losses(),
        "grad_norms": result.grad_norms(),
        "saved_bytes": last.total_bytes,
        "lora_input_bytes": last.module_bytes("lora_input"),
        "attention_bytes": last.by_category.get("attention", 0),
        "lora_input_by_module": lora_inputs,
        "core_attn_recompute": result.steps[-1].recompute,
        "environment": result.steps[-1].environment,
    }


def format_tables(rows: list[dict]) -> str:
    from megatron_bridge_ext.table import text_table

    steps = range(1, len(rows[0]["losses"]) + 1)
    bounds = rounding_bounds()
    d_loss = decimals(bounds["loss"], [v for r in rows for v in r["losses"]])
    d_norm = decimals(bounds["grad_norm"], [v for r in rows for v in r["grad_norms"]])
    losses = text_table(["iteration"] + [r["variant"] for r in rows],
                        [[str(i)] + [f"{r['losses'][i - 1]:.{d_loss}f} / {r['grad_norms'][i - 1]:.{d_norm}f}"
                                     for r in rows] for i in steps])
    memory = text_table(
        ["variant", "saved/micro-batch", "LoRA-A inputs", "attention", "core_attn ckpt/recomputed per step"],
        [[r["variant"], f"{r['saved_bytes']:,} B", f"{r['lora_input_bytes']:,} B", f"{r['attention_bytes']:,} B",
          "{checkpointed_forwards}/{recomputed}".format(**r["core_attn_recompute"])] for r in rows])
    env = "; ".join(f"{k}={v!r}" for k, v in rows[-1]["environment"].items() if "ALLOC" in k)
    return ("Megatron Bridge pretrain + finetune (tiny GPT: 2 layers, hidden 64, seq 32, TP=2 + SP, fp32; LoRA r=8 "
            "on qkv/proj/fc1/fc2)\n\nloss / grad norm per iteration (rank 0):\n" + losses
            + "\n\nsaved activations per micro-batch forward, inside Bridge's forward_step (rank 0):\n" + memory
            + f"\n\nallocator variables in the ranks' environment (from cfg.env_vars): {env or '(none)'}")
