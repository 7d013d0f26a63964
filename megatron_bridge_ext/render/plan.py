"""What ``mbx plan`` prints: the plan as text (the estimate beside Bridge's, the phases, the fit, the step time,
the lever walk, the answer, the assumptions) and as JSON.

Pure: a :class:`~megatron_bridge_ext.planner.Plan` (or anything with its attributes) in, text out; nothing
here parses options or imports Bridge. Sizes are in GiB (:func:`megatron_bridge_ext.sizes.gib`); GB appear
only beside figures Bridge prints or publishes in GB.
"""

from __future__ import annotations

import json
import textwrap
from typing import TYPE_CHECKING

from megatron_bridge_ext.levers import steptime
from megatron_bridge_ext.sizes import gib, sold_as_note

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.settings import Settings

NOT_MODELLED_STATUS = 3
"""Exit status of a plan printed without our estimate (the config is fine, but no fits/does-not-fit verdict)."""


def plan_json(result, *, gpu_defaulted: bool) -> str:
    """The plan as ``--json`` prints it; ``gpu_defaulted``: no --gpu was given."""
    report = result.as_dict()
    report["gpu"]["defaulted"] = gpu_defaulted
    return json.dumps(report, indent=2, default=str)


NO_PEFT = "no PEFT: every parameter trained"
"""The config line's words for a config without PEFT: pretraining or full fine-tuning (the estimate cannot tell
which, and the memory is the same)."""


def settings_line(s: Settings, *, peft_defaulted: bool = False) -> str:
    """The config in one line; ``peft_defaulted``: no --peft was given, so say that training without PEFT is the
    default."""
    kind = {"dora": "DoRA", "canonical_lora": "CanonicalLoRA"}.get(s.peft and s.peft.kind, "LoRA")
    if s.peft:
        peft = (f"{kind} r={s.peft.lora_dim} on {','.join(s.peft.lora_targets)}, "
                f"sequence_parallel_input_strategy={s.peft.sequence_parallel_input_strategy}")
    else:
        peft = NO_PEFT + (" (the default; --peft lora for LoRA)" if peft_defaulted else "")
    recompute = s.recompute_granularity or "none"
    if recompute == "selective":
        recompute += f" {list(s.recompute_modules)}"
    vpp = f" VPP={s.vpp}" if s.vpp else ""
    return (f"TP={s.tp} PP={s.pp}{vpp}{_experts_sizes(s)} "
            f"DP={s.dp} SP={'on' if s.sequence_parallel else 'off'}, seq {s.seq_length}, micro-batch "
            f"{s.micro_batch}, {s.num_microbatches} microbatch(es)/step, {_precision(s)}, {peft}, recompute "
            f"{recompute}, attention {s.attention}{_latent_attention(s)}, {s.transformer_impl}{_hybrid_layers(s)}"
            f"{_experts_load(s)}")


def _precision(s: Settings) -> str:
    """The parameters' dtype, and the FP8 recipe when the linears run in FP8."""
    return f"{s.dtype} with {s.fp8}" if s.fp8 else s.dtype


def _latent_attention(s: Settings) -> str:
    """A multi-latent attention model's latent ranks and head widths, by their config names."""
    m = s.mla
    if not m:
        return ""
    query = "None (the query projected directly)" if m.q_lora_rank is None else m.q_lora_rank
    return (f" multi-latent (q_lora_rank={query}, kv_lora_rank={m.kv_lora_rank}, qk_head_dim={m.qk_head_dim}, "
            f"qk_pos_emb_head_dim={m.qk_pos_emb_head_dim}, v_head_dim={m.v_head_dim})")


def _hybrid_layers(s: Settings) -> str:
    layers = s.hybrid and s.hybrid.layers
    return (", hybrid: " + ", ".join(f"{n} {name}" for name, n in layers.items())) if layers else ""


def _experts_sizes(s: Settings) -> str:
    return f" EP={s.moe.ep} ETP={s.moe.etp}" if s.moe else ""


def _experts_load(s: Settings) -> str:
    """An MoE config's experts and the load the estimate assumed (never silent: the default says it is one)."""
    if not s.moe:
        return ""
    load = ("1.0 (balanced, the default; --moe-imbalance sets the most loaded expert's share)"
            if s.moe.imbalance == 1.0 else f"{s.moe.imbalance:g} x balanced on this rank's experts")
    return (f", {s.moe.experts} experts (top-{s.moe.topk}, {s.moe.local_experts} on this rank, "
            f"{s.moe.dispatcher} dispatcher), expert load {load}")


def format_plan(result, command_line: str | None = None, *, peft_defaulted: bool = False,
                gpu_defaulted: bool = True) -> str:
    """The plan as text: the estimate beside Bridge's, the fit, the step time, the levers, the answer, the
    assumptions. ``gpu_defaulted``: no --gpu was given, so say that the device is the default.

    Every size is in GiB; GB appear only beside figures published in GB.
    """
    est = result.baseline
    lines = [f"$ {command_line}"] if command_line else []
    if est is None:
        return "\n".join(lines + _without_estimate(result))
    lines += [f"config: {settings_line(est.settings, peft_defaulted=peft_defaulted)}"
              + "".join(f"; {n}" for n in result.notes),
              f"per-rank estimate, pipeline stage {est.stage} (the most loaded), TP rank 0 ({est.seconds:.1f} s):",
              _indent(est.table())]
    lines += _phase_lines(result)
    lines += _bridge_lines(result)
    lines += _strategy_lines(result)
    lines += _not_modelled_lines(result)
    lines += _device_lines(result)
    lines += _step_time_lines(result, gpu_defaulted)
    verdict = "fits as is" if result.fits_as_is else "does not fit as is"
    lines.append(f"{verdict}: peak {gib(est.peak_bytes)} ({est.peak_phase.name}) of {gib(result.usable_now)} usable")
    lines += _out_of_memory_later(result)
    if result.options:
        lines += _levers(result.options)
    lines += _answer(result)
    lines.append("assumptions:")
    lines += [_wrap(a) for a in est.assumptions if a not in result.not_modelled]  # those are printed above
    return "\n".join(lines)


def _phase_lines(result) -> list[str]:
    """Every phase's peak, then what each memory report of Bridge's log will print (the unit Bridge prints)."""
    from megatron_bridge_ext.estimate.phases import predicted_reports

    est = result.baseline
    lines = ["by phase (the verdict takes the largest):", _indent(est.phase_table())]
    reports = predicted_reports(est)
    if reports:
        lines.append("Bridge's log will print (\"(after N iterations) memory (GB)\", GB = 10^9 bytes, on DP rank 0 of "
                     "each TP rank of each stage):")
    for r in reports:
        extra = f"; {r.unmodelled}" if r.unmodelled else ""
        lines.append(f"  after {r.iteration} iteration(s), stage {r.stage} (ranks {', '.join(map(str, r.ranks))}): "
                     f"mem-max-allocated-gigabytes {r.max_allocated_gigabytes} ({r.phase}), "
                     f"mem-allocated-gigabytes {r.allocated_gigabytes}{extra}")
    return lines


def _out_of_memory_later(result) -> list[str]:
    """One line when iteration 1's forward and backward fit and a later phase does not."""
    from megatron_bridge_ext.estimate import phases

    est, usable = result.baseline, result.usable_now
    by_name = {p.name: p for p in est.phases}
    first = by_name.get(phases.ITERATION_1)
    if first is None or first.peak_bytes > usable or est.peak_bytes <= usable:
        return []
    where = {phases.FIRST_STEP: "iteration 1 at the first optimizer step",
             phases.RESUME: "loading the checkpoint's optimizer state before it",
             phases.CUDA_GRAPHS: f"iteration {est.settings.reports.cuda_graph_first_iteration} once its CUDA graphs "
                                 "are captured"}.get(est.peak_phase.name, "iteration 2 at the steady state")
    return [f"  fits iteration 1 ({gib(first.peak_bytes)} in its forward and backward), runs out of memory in {where} "
            f"({gib(est.peak_bytes)} of {gib(usable)} usable)"]


def _bridge_lines(result) -> list[str]:
    """Bridge's estimate as a table (with the difference from ours when ours ran), or the one line of its failure."""
    from megatron_bridge_ext.table import text_table

    if result.bridge_error is not None:
        return [f"Bridge's estimate_training_memory failed: {result.bridge_error}"]
    if result.bridge is None:
        return []
    rows = [[name, gib(nbytes)] for name, nbytes in result.bridge.components]
    rows.append(["total", gib(result.bridge.total_bytes)])
    lines = ["Bridge's estimate_training_memory for the same config, per rank (not PEFT-aware):",
             _indent(text_table(["component", "bytes"], rows))]
    lines += [_wrap(f"note: {c}", "  ") for c in result.bridge.caveats]
    if result.baseline is not None:
        diff = result.bridge.total_bytes - result.baseline.peak_bytes
        lines.append(f"  Bridge minus ours: {'+' if diff >= 0 else '-'}{gib(abs(diff))}")
    return lines


def _strategy_lines(result) -> list[str]:
    """The LoRA-A input strategies side by side on the config as is: peak, LoRA-input bytes, saving against off."""
    if not result.strategies:
        return []
    by_name = {p.strategy: p for p in result.strategies}
    off = by_name.get("off")
    lines = ["LoRA-A input under sequence parallelism, each strategy on the config as is (re-estimated):"]
    for p in result.strategies:
        if p.peak_bytes is None:
            lines.append(_wrap(f"{p.strategy}: not applicable: {p.reason}", "  "))
            continue
        text = f"  {p.strategy}: peak {gib(p.peak_bytes)}, LoRA inputs {gib(p.lora_input_bytes)}"
        if off is not None and off.peak_bytes is not None and p is not off:
            text += f", saves {gib(off.peak_bytes - p.peak_bytes)} against off"
        lines.append(text + (f" ({p.reason})" if p.reason else ""))
    return lines


def _not_modelled_lines(result) -> list[str]:
    """What this config switches on that no figure above counts (CUDA graph pools, FP8 activations), one line
    each."""
    return [f"not modelled: {line}" for line in result.not_modelled]


def _device_lines(result) -> list[str]:
    """The device, the margin kept free and what is usable."""
    margin = result.expandable_margin if result.expandable_segments else result.margin
    lines = [f"device: {gib(result.gpu_memory)}; usable {gib(result.usable_now)} after a {margin:.0%} margin "
             f"({'with' if result.expandable_segments else 'without'} expandable segments: allocator "
             "fragmentation, NCCL buffers, CUDA context, workspaces)"]
    sold_as = sold_as_note(result.gpu_memory, "--gpu-memory")
    if sold_as:
        lines.append(_wrap(f"note: {sold_as}", "  "))
    return lines


def _step_time_lines(result, gpu_defaulted: bool) -> list[str]:
    """The device that prices the options' step time, and the config's own step time by term."""
    g, t = result.gpu, result.step_time
    others = "|".join(name for name in steptime.GPUS if name != g.name)
    default = f"; the default, --gpu {others} to change" if gpu_defaulted else ""
    terms = ", ".join(f"{name.replace('_', ' ')} {seconds:.3f}" for name, seconds in vars(t).items())
    return [_wrap(f"step time (calibrated on published throughput, {g.name}: {g.bf16_flops / 1e12:,.1f} TFLOP/s "
                  f"dense bf16 at a GEMM efficiency by size, "
                  f"HBM {g.hbm / 1e12:g} TB/s, NVLink {g.nvlink / 1e9:g} GB/s and InfiniBand {g.ib / 1e9:g} GB/s per "
                  f"GPU and direction, PCIe {g.pcie / 1e9:g} GB/s; {g.source}{default}): "
                  f"{t.total:.3f} s per step as is ({terms}); "
                  "each option's time is its config's change against this", "")]


def _layout_line(layout: dict) -> str:
    """The config in one line from its sizes alone (for a plan without our estimate)."""
    experts = (f", {layout['num_moe_experts']} experts (top-{layout['moe_router_topk']})"
               if layout.get("num_moe_experts") else "")
    return (f"TP={layout['tp']} PP={layout['pp']} CP={layout['cp']} EP={layout['ep']} ETP={layout['etp']} "
            f"DP={layout['dp'] or 'unknown'} SP={'on' if layout['sequence_parallel'] else 'off'}, seq "
            f"{layout['seq_length']}, micro-batch {layout['micro_batch']}{experts}")


def _without_estimate(result) -> list[str]:
    """A plan whose config our estimate does not model: Bridge's figure, our refusal, and no verdict."""
    lines = [f"config: {_layout_line(result.layout)}" + "".join(f"; {n}" for n in result.notes),
             f"our estimate: not modelled: {result.refused.one_line()}"]
    lines += _bridge_lines(result)
    lines += _not_modelled_lines(result)
    lines += _device_lines(result)
    lines.append(f"fits: no verdict without our estimate (Bridge's is not PEFT-aware); exit status "
                 f"{NOT_MODELLED_STATUS}")
    return lines


def _levers(options) -> list[str]:
    """The levers tried as a narrow table (why an option does not apply goes to the notes below it)."""
    from megatron_bridge_ext.evidence import LEVERS
    from megatron_bridge_ext.table import text_table

    names = ", ".join(f"{lever['step']} {lever['name']}" for lever in LEVERS)
    lines = ["levers, in the decision order (each on top of the ones before):", _wrap(f"(steps: {names})", "  ")]
    rows = [[str(o.step), o.label, gib(o.peak_bytes) if o.peak_bytes is not None else "-", gib(o.usable_bytes),
             ("yes" if o.fits else "no") if o.applicable else "n/a", _time(o), o.cost.measured()] for o in options]
    lines.append(_indent(text_table(["step", "option", "peak", "usable", "fits", "time", "cost"], rows)))
    notes = [f"step {o.step} {o.label}: n/a: {o.reason}" for o in options if o.reason]
    notes += [f"step {o.step}: {c}" for o in options for c in o.constraints if c.text() != o.reason]
    notes += [f"step {o.step} cost: {o.cost.basis}" for o in options if o.cost.basis]
    notes += [f"step {o.step} published: {o.cost.published}"
              + (f" [{o.cost.source}]" if o.cost.source and o.cost.source not in o.cost.published else "")
              for o in options if o.cost.published and o.applicable]
    notes = list(dict.fromkeys(notes))
    if notes:
        lines.append("why not, constraints, cost formulas and published figures:")
        lines += [_wrap(n) for n in notes]
    return lines


def _time(option) -> str:
    """The option's predicted step-time change against the config as is, e.g. ``+12.3%``."""
    pct = option.cost.step_time_pct
    return "-" if pct is None else f"{pct:+.1f}%"


def _answer(result) -> list[str]:
    """The first option that fits, as MemoryConfig and overrides (or what is left when none does)."""
    chosen = result.chosen
    if result.fits_as_is:
        return ["answer: no lever needed"]
    if chosen is None:
        return [f"answer: no combination of the levers fits; {_left(result)} are left"]
    flags = ", ".join(f"{k}={v!r}" for k, v in chosen.flags.items())
    what = f"step {chosen.step}" if chosen.step else "the fastest fitting combination of the levers"
    lines = [f"answer: {what} ({chosen.label}), peak {gib(chosen.peak_bytes)}, step time {_time(chosen)}",
             f"  MemoryConfig({flags})",
             f"  overrides: {' '.join(chosen.overrides) or '(none)'}"]
    if chosen.saves:
        lines.append(_wrap("each lever's saving at the peak (the answer without it): " + "; ".join(
            f"{lever} {gib(saved)}" for lever, saved in chosen.saves.items()), "  "))
    if chosen.peft_note:
        lines.append(f"  {chosen.peft_note}")
    if chosen.flags.get("expandable_segments"):
        lines.append("  allocator: launch with `mbx run -- torchrun ...` or call megatron_bridge_ext.init() first")
    return lines


def _left(result) -> str:
    """What is left when no lever fits: a smaller micro-batch only where the micro-batch is above 1."""
    left = ["more GPUs", "a shorter sequence"]
    if result.baseline.settings.micro_batch > 1:
        left.append("a smaller micro-batch")
    return ", ".join(left[:-1]) + " or " + left[-1]


def _wrap(text: str, indent: str = "  - ") -> str:
    return textwrap.fill(text, width=120, initial_indent=indent, subsequent_indent="    ")


def _indent(text: str) -> str:
    return textwrap.indent(text, "  ")
