"""``mbx plan --search`` as text and JSON: the answer, the front, and the walk's figures."""

from __future__ import annotations

import json

from megatron_bridge_ext.sizes import gib


def changes(given, c) -> str:
    """What candidate ``c`` changes against the config as given, in a few words."""
    names = {"tp": "TP", "pp": "PP", "vpp": "VPP", "cp": "CP", "ep": "EP", "etp": "ETP", "dp": "DP", "sp": "SP",
             "micro_batch": "mb", "recompute": "recompute", "distributed_optimizer": "distopt", "fsdp": "FSDP",
             "bf16_moments": "bf16 moments", "offload": "offload", "optimizer_offload": "optimizer offload",
             "optimizer_overlap": "offload overlap"}
    if given.ep == c.ep == 1:  # no expert parallelism on either side: the expert TP follows TP
        names.pop("etp")
    out = [f"{label} {_v(getattr(given, k), k)}->{_v(getattr(c, k), k)}" for k, label in names.items()
           if getattr(given, k) != getattr(c, k)]
    return ", ".join(out) or "as given"


def _v(value, key: str = "") -> str:
    if key in ("fsdp", "optimizer_offload"):
        return "off" if value is None else f"{value:g}" if isinstance(value, float) else value
    if isinstance(value, tuple):
        return "+".join(value) or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def row(result, e) -> dict:
    tokens = result.global_batch * result.seq / e.step_time_s / result.world
    return {"candidate": e.candidate.describe(), "overrides": e.candidate.overrides(result.layers, result.given)
            + (["env_vars.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"] if e.expandable else []),
            "memory_config": memory_config_line(e, shard_local=result.shard_local), "peak_bytes": e.peak_bytes,
            "peak_phase": e.peak_phase, "fits": e.fits, "step_time_s": e.step_time_s, "tokens_per_s_per_gpu": tokens,
            "tflops_per_gpu": e.flops / e.step_time_s / 1e12,
            "changes": changes(result.given, e.candidate)
            + (", LoRA-A input off->shard_local" if result.shard_local and e.candidate.sp else "")}


def memory_config_line(e, *, shard_local: bool = False) -> str:
    """The MemoryConfig line of candidate ``e``: the allocator, selective recompute, and the LoRA-A input
    ``shard_local`` where the search set it (``shard_local`` and SP on)."""
    rc = e.candidate.recompute
    modules = list(rc) if isinstance(rc, tuple) and rc else None
    strategy = ", sequence_parallel_input_strategy='shard_local'" if shard_local and e.candidate.sp else ""
    return f"MemoryConfig(expandable_segments={e.expandable}, recompute_modules={modules!r}{strategy})"


def as_dict(result) -> dict:
    answer = result.answer
    return {"answer": row(result, answer) if answer else None,
            "margin_bytes": result.usable_expandable - answer.peak_bytes if answer else None,
            "front": [row(result, e) for e in result.front],
            "given": row(result, result.given_evaluated()) if result.given_evaluated() else None,
            "counts": result.counts, "seconds": result.seconds, "world": result.world,
            "usable_bytes": result.usable, "usable_expandable_bytes": result.usable_expandable}


def as_json(result) -> str:
    return json.dumps({"search": as_dict(result)}, indent=2)


def as_text(result) -> str:
    d = as_dict(result)
    lines = [f"search: {result.world} GPUs, global batch {result.global_batch}, sequence {result.seq}; "
             f"usable {gib(result.usable)} ({gib(result.usable_expandable)} with expandable segments)",
             "walk: " + ", ".join(f"{k} {v}" for k, v in result.counts.items())
             + "; seconds " + ", ".join(f"{k} {v:.1f}" for k, v in result.seconds.items())]
    if result.refused:
        first = next(iter(result.refused.items()))
        lines.append(f"not estimable: {len(result.refused)} candidates, e.g. {first[0].describe()}: {first[1][:160]}")
    if d["given"]:
        g = d["given"]
        lines.append(f"as given: {g['candidate']}: peak {gib(g['peak_bytes'])} ({g['peak_phase']}), "
                     f"step {g['step_time_s']:.3f} s, {'fits' if g['fits'] else 'does not fit'}")
    a = d["answer"]
    if a is None:
        lines.append("answer: no candidate estimated fits")
    else:
        lines += [f"answer: {a['candidate']}: peak {gib(a['peak_bytes'])} ({a['peak_phase']}), margin "
                  f"{gib(d['margin_bytes'])}, step {a['step_time_s']:.3f} s",
                  "  overrides: " + " ".join(a["overrides"]), "  " + a["memory_config"] + ".apply(cfg)"]
    lines.append("front (peak memory against step time, fastest first):")
    lines.append(f"  {'peak':>10}  {'phase':<22} {'step s':>7} {'tok/s/GPU':>9} {'TFLOP/s':>8}  fits  changes")
    for r in d["front"]:
        lines.append(f"  {gib(r['peak_bytes']):>10}  {r['peak_phase']:<22} {r['step_time_s']:>7.3f} "
                     f"{r['tokens_per_s_per_gpu']:>9.0f} {r['tflops_per_gpu']:>8.0f}  {'yes' if r['fits'] else 'no ':<4}  "
                     f"{r['changes']}")
    return "\n".join(lines)


def plot(result, path: str) -> None:
    """Every estimated candidate a point (fits or not), the front joined, the answer marked; GiB against seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for fits, colour, label in ((True, "tab:green", "fits"), (False, "tab:red", "does not fit")):
        pts = [e for e in result.evaluated if e.fits == fits]
        ax.scatter([e.step_time_s for e in pts], [e.peak_bytes / 2**30 for e in pts], s=10, c=colour, label=label)
    front = result.front
    ax.plot([e.step_time_s for e in front], [e.peak_bytes / 2**30 for e in front], c="black", lw=1, label="front")
    if result.answer:
        ax.scatter([result.answer.step_time_s], [result.answer.peak_bytes / 2**30], s=120, marker="*", c="gold",
                   edgecolors="black", label="answer", zorder=3)
    ax.axhline(result.usable_expandable / 2**30, ls="--", c="grey", lw=1)
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
