"""``mbx plan``: per-rank memory of a Bridge config before launch, and the first lever that makes it fit."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import textwrap
import warnings

from megatron_bridge_ext.estimate.report import GB, gib

PLOT_EXTRA = 'pip install "megatron-bridge-ext[plot]"'


def add_parser(sub, parse_size) -> None:
    p = sub.add_parser(
        "plan", help="estimate per-rank memory of a Bridge config (PEFT-aware, measured from the layer code) and walk "
                     "the OOM levers in order until one fits",
        description="Input: a Bridge recipe (--recipe MODULE:FUNCTION) or a Hugging Face config.json (--hf-config), "
                    "parallel sizes, sequence, micro-batch and --gpu-memory; Hydra-style OVERRIDES apply last.")
    p.add_argument("--recipe", help="a Bridge recipe function, MODULE:FUNCTION")
    p.add_argument("--hf-config", help="a Hugging Face config.json (read offline); with --recipe, it answers the "
                                       "recipe's read of the model's config from the hub")
    p.add_argument("--gpu-memory", type=parse_size, required=True, help="device memory per GPU, e.g. 80GB or 80GiB")
    p.add_argument("--tp", type=int, help="tensor parallel size")
    p.add_argument("--pp", type=int, help="pipeline parallel size")
    p.add_argument("--dp", type=int, help="data parallel size (divides the distributed optimizer's states)")
    p.add_argument("--seq", type=int, help="sequence length")
    p.add_argument("--micro-batch", type=int, help="micro-batch size")
    p.add_argument("--global-batch", type=int, help="global batch size (default with --hf-config: micro-batch x DP x PP)")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when TP > 1, for --hf-config and whenever --tp is given; "
                        "a recipe without --tp keeps its own)")
    p.add_argument("--peft", choices=("lora", "dora", "canonical_lora", "none"),
                   help="Bridge's LoRA, DoRA or CanonicalLoRA on the four linear layers, or full fine-tuning")
    p.add_argument("--lora-dim", type=int, default=32, help="LoRA rank (default 32, Bridge's default)")
    p.add_argument("--expandable-segments", choices=("on", "off"), default=None,
                   help="the run's allocator setting (default: from the recipe's env_vars; off for --hf-config)")
    p.add_argument("--margin", type=float, default=None,
                   help="share of device memory kept free without expandable segments (default 0.10)")
    p.add_argument("--attention", choices=("fused", "local"), default=None,
                   help="fused (flash/cuDNN, default) or Megatron Core's unfused local attention")
    p.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                   help="default: the config's model.transformer_impl")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE", help=f"draw a stacked bar per option to FILE (needs matplotlib: {PLOT_EXTRA})")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDES", help="Hydra-style overrides, e.g. model.seq_length=8192")
    p.set_defaults(func=command)


def command(args) -> int:
    from megatron_bridge_ext import logs
    from megatron_bridge_ext.findings import Refused

    logs.configure()
    # Chatter that says nothing about the plan: torch looking for a CUDA toolkit, Bridge turning
    # gradient_accumulation_fusion off without TE/Apex (the estimate does that too), transformers on
    # the spelling of config.json's dtype field, which Bridge reads.
    for name in ("torch.utils.cpp_extension", "megatron.bridge.utils.fusions"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r".*MimoModelConfig is experimental.*")
    if not (args.recipe or args.hf_config):
        return _fail("give --recipe MODULE:FUNCTION or --hf-config FILE. Fix: add one (both: the recipe, with its "
                     "Hugging Face config read from the file)")
    if args.plot and not _have_matplotlib():
        return _fail(f"--plot needs matplotlib. Fix: {PLOT_EXTRA}")
    if args.margin is not None and not 0 <= args.margin < 1:
        return _fail(f"--margin: {args.margin} is not a share between 0 and 1. Fix: give e.g. 0.10")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # upstream prints while models are built; stdout is the plan's
            result = _plan(args)
    except Refused as refused:
        return _fail(refused.one_line())
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, default=str))
    else:
        print(format_plan(result, command_line=" ".join(["mbx plan", *sys.argv[2:]]) if sys.argv[1:2] == ["plan"]
                          else None))
    return 0


def _fail(line: str) -> int:
    print(f"mbx plan: {line}", file=sys.stderr)
    return 2


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _plan(args):
    from megatron_bridge_ext import plan as planner
    from megatron_bridge_ext.estimate import configs

    layout = configs.Layout(tp=args.tp, pp=args.pp, dp=args.dp, seq=args.seq, micro_batch=args.micro_batch,
                            global_batch=args.global_batch, sequence_parallel=args.sp, peft=args.peft,
                            lora_dim=args.lora_dim, lora_alpha=args.lora_dim)
    built = configs.build(layout, args.overrides, recipe=args.recipe, hf_config=args.hf_config)
    expandable = None if args.recipe else False
    if args.expandable_segments is not None:
        expandable = args.expandable_segments == "on"
    options = {k: v for k, v in (("attention", args.attention), ("transformer_impl", args.transformer_impl)) if v}
    result = planner.plan(built.cfg, gpu_memory=args.gpu_memory, expandable_segments=expandable,
                          estimate_options=options, peft_overrides=built.peft_overrides,
                          **({"margin": args.margin} if args.margin is not None else {}))
    result.notes = built.notes
    return result


def _settings_line(s: dict) -> str:
    kind = {"dora": "DoRA", "canonical_lora": "CanonicalLoRA"}.get(s.get("peft_kind"), "LoRA")
    peft = "full fine-tuning" if not s.get("peft") else (
        f"{kind} r={s['lora_dim']} on {','.join(s['lora_targets'])}, LoRA-A input {s['lora_sp_input']}")
    recompute = s["recompute_granularity"] or "none"
    if recompute == "selective":
        recompute += f" {s['recompute_modules']}"
    vpp = f" VPP={s['vpp']}" if s["vpp"] else ""
    return (f"TP={s['tp']} PP={s['pp']}{vpp} "
            f"DP={s['dp']} SP={'on' if s['sequence_parallel'] else 'off'}, seq {s['seq_length']}, micro-batch "
            f"{s['micro_batch']}, {s['num_microbatches']} microbatch(es)/step, {s['dtype']}, {peft}, recompute "
            f"{recompute}, attention {s['attention']}, {s['transformer_impl']}")


def format_plan(result, command_line: str | None = None) -> str:
    """The plan as text: the estimate beside Bridge's, the fit, the levers, the answer, the assumptions."""
    from megatron_bridge_ext.table import text_table

    est = result.baseline
    lines = [f"$ {command_line}"] if command_line else []
    lines += [f"config: {_settings_line(est.settings)}" + "".join(f"; {n}" for n in result.notes),
              f"per-rank estimate, pipeline stage {est.stage} (the most loaded), TP rank 0 ({est.seconds:.1f} s):",
              _indent(est.table())]
    if result.bridge is not None:
        rows = [[name, gib(nbytes)] for name, nbytes in result.bridge.components]
        rows.append(["total", gib(result.bridge.total_bytes)])
        diff = result.bridge.total_bytes - est.peak_bytes
        lines += ["Bridge's estimate_training_memory for the same config (not PEFT-aware):",
                  _indent(text_table(["component", "bytes"], rows)),
                  f"  Bridge minus ours: {'+' if diff >= 0 else '-'}{gib(abs(diff))}"]
    margin = result.expandable_margin if result.expandable_segments else result.margin
    lines.append(f"device: {result.gpu_memory / GB:.1f} GB; usable {gib(result.usable_now)} after a {margin:.0%} margin "
                 f"({'with' if result.expandable_segments else 'without'} expandable segments: allocator "
                 "fragmentation, NCCL buffers, CUDA context, workspaces)")
    verdict = "fits as is" if result.fits_as_is else "does not fit as is"
    lines.append(f"{verdict}: peak {gib(est.peak_bytes)} of {gib(result.usable_now)} usable")
    if result.options:
        lines.append("levers, in the decision order (each on top of the ones before):")
        rows = [[str(o.step), o.lever, o.label, gib(o.peak_bytes) if o.peak_bytes is not None else "-",
                 gib(o.usable_bytes), ("yes" if o.fits else "no") if o.applicable else "n/a", o.cost.measured()]
                for o in result.options]
        lines.append(_indent(text_table(["step", "lever", "option", "peak", "usable", "fits", "cost"], rows)))
        notes = [f"step {o.step}: {c}" for o in result.options for c in o.constraints]
        notes += [f"step {o.step} cost: {o.cost.basis}" for o in result.options if o.cost.basis]
        notes += [f"step {o.step} published: {o.cost.published}"
                  + (f" [{o.cost.source}]" if o.cost.source and o.cost.source not in o.cost.published else "")
                  for o in result.options if o.cost.published and o.applicable]
        notes = list(dict.fromkeys(notes))
        if notes:
            lines.append("constraints, cost formulas and published figures:")
            lines += [textwrap.fill(n, width=120, initial_indent="  - ", subsequent_indent="    ") for n in notes]
    chosen = result.chosen
    if result.fits_as_is:
        lines.append("answer: no lever needed")
    elif chosen is None:
        lines.append("answer: no combination of the levers fits; more GPUs, a shorter sequence or a smaller "
                     "micro-batch are left")
    else:
        flags = ", ".join(f"{k}={v!r}" for k, v in chosen.flags.items())
        lines += [f"answer: step {chosen.step} ({chosen.label}), peak {gib(chosen.peak_bytes)}",
                  f"  MemoryConfig({flags})",
                  f"  overrides: {' '.join(chosen.overrides) or '(none)'}"]
        if chosen.peft_note:
            lines.append(f"  {chosen.peft_note}")
        if chosen.flags.get("expandable_segments"):
            lines.append("  allocator: launch with `mbx run -- torchrun ...` or call megatron_bridge_ext.init() first")
    lines.append("assumptions:")
    lines += [textwrap.fill(a, width=120, initial_indent="  - ", subsequent_indent="    ") for a in est.assumptions]
    return "\n".join(lines)


def _indent(text: str) -> str:
    return textwrap.indent(text, "  ")


def plot(result, path: str) -> None:
    """A stacked bar per option (the config as is, then each evaluated lever): where the memory goes,
    with the device size and each option's usable share (after its margin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_bridge_ext.plan import breakdown

    bars = [("as is", breakdown(result.baseline), result.usable_now)]
    bars += [(f"{o.step}: {o.label}", o.breakdown, o.usable_bytes) for o in result.options if o.applicable and o.breakdown]
    keys = list(dict.fromkeys(k for _, parts, _ in bars for k in parts))
    colours = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(3 + 1.5 * len(bars), 5))
    bottoms = [0.0] * len(bars)
    for index, key in enumerate(keys):
        values = [parts.get(key, 0) / GB for _, parts, _ in bars]
        ax.bar(range(len(bars)), values, bottom=bottoms, label=key, color=colours[index % len(colours)])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.axhline(result.gpu_memory / GB, color="black", linewidth=1, label="device memory")
    for x, (_, _, usable) in enumerate(bars):
        ax.hlines(usable / GB, x - 0.45, x + 0.45, colors="black", linestyles="--", linewidth=1,
                  label="usable after the margin" if x == 0 else None)
    ax.set_ylim(0, 1.05 * max(max(bottoms), result.gpu_memory / GB))
    ax.set_xticks(range(len(bars)), [textwrap.fill(label, 18) for label, _, _ in bars], fontsize=7)
    ax.set_ylabel("GB per GPU at the peak (10^9 bytes)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
