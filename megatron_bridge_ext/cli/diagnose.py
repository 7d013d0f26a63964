"""``mbx diagnose``: parsing and printing only; the readers and the classifier are :mod:`megatron_bridge_ext.diagnose`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_bridge_ext.sizes import TIB

EXAMPLES = """
mbx diagnose train.log oom_rank3.snapshot.pickle   # a merged log of every rank, a snapshot, a stats JSON...
mbx diagnose logs/ --tp 2 --pp 2 --plot ranks.png  # a directory of per-rank logs; per-rank bars by stage
kubectl logs job/train | mbx diagnose -            # standard input; .gz files are read as they are
"""
SIZES = ("tp", "pp", "cp", "ep", "etp", "dp")
MAX_DEVICE = TIB
"""No GPU holds a tebibyte: a larger --total-memory is a unit slip (80TB for 80GB)."""


def add_parser(sub, make_parser) -> None:
    p = make_parser(sub, "diagnose", EXAMPLES,
                    help="why a run ran out of memory: reads training logs (every rank), PyTorch's OOM messages, "
                         "Bridge's and Megatron's memory lines, memory snapshots, memory_stats() JSON",
                    description="Reads every INPUT (files, directories, - for standard input; gzip or not), places "
                                "each rank in the parallel layout, and says per failing rank: fragmentation, "
                                "capacity, CUDA-graph pools or memory outside PyTorch's allocator, with the next "
                                "step. Figures in GiB (2^30 bytes).")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="a training log, a directory of them, a memory snapshot pickle, a memory_stats() JSON or "
                        "oom_rank<N>.json of the OOM handler, or - (standard input)")
    p.add_argument("--total-memory", metavar="SIZE", default=None,
                   help="device memory with its unit: 80GiB (2^30 bytes) or 85.5GB (10^9 bytes); a GPU sold as "
                        "\"80GB\" holds about 80GiB (default: the OOM report's figure; none for a stats dump)")
    p.add_argument("--expandable-segments", choices=("on", "off"), default=None,
                   help="allocator state at the OOM, when the inputs do not say (default: the OOM report's, "
                        "else unknown)")
    for size in SIZES:
        p.add_argument(f"--{size}", type=int, default=None, metavar="N",
                       help=f"the run's {size.upper()} size, when the log does not print it (default: the log's)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw per-rank max allocated and max reserved against the device total, grouped by "
                        "pipeline stage (a snapshot alone: its segment map) (default: no picture)")
    p.add_argument("--json", action="store_true", help="print everything as JSON (default: text)")
    p.add_argument("--plan", nargs=argparse.REMAINDER, metavar="PLAN-ARGS", default=None,
                   help="last: the run's config as mbx plan takes it (--hf-config or --recipe, --tp, ..., key=value "
                        "overrides); each memory report is set beside the estimate of its phase and stage, and the "
                        "layout is the config's (default: no estimate)")
    p.set_defaults(func=command)


def _fail(message: str) -> int:
    print(f"mbx diagnose: {message}", file=sys.stderr)
    return 2


def _check_plot(path: str):
    """A --plot path that cannot be written is refused before any input is read."""
    if not path.lower().endswith(".png"):
        return f"--plot {path}: give a .png file name (e.g. --plot ranks.png)"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--plot {path}: the folder {folder} does not exist. Fix: create it or write the picture elsewhere"
    if not os.access(folder, os.W_OK):
        return f"--plot {path}: the folder {folder} is not writable. Fix: write the picture elsewhere"
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return '--plot needs matplotlib. Fix: pip install "megatron-bridge-ext[plot]"'
    return None


def command(args: argparse.Namespace) -> int:
    from megatron_bridge_ext.sizes import SizeError, parse_size

    try:  # every option first: a bad one is refused before any input is read
        total = None if args.total_memory is None else parse_size(args.total_memory, "--total-memory")
    except SizeError as error:
        return _fail(str(error))
    if total is not None and total > MAX_DEVICE:
        return _fail(f"--total-memory {args.total_memory} is more than any GPU holds (1 TiB). Fix: the device's "
                     "memory, e.g. --total-memory 80GiB")
    sizes = {s: getattr(args, s) for s in SIZES}
    for name, value in sizes.items():
        if value is not None and value < 1:
            return _fail(f"--{name} {value}: a parallel size is a whole number >= 1")
    if args.plot and (problem := _check_plot(args.plot)):
        return _fail(problem)
    plan_args = None
    if args.plan is not None:
        plan_args, problem = _plan_args(args.plan)
        if problem:
            return _fail(problem)
    from megatron_bridge_ext.diagnose.collect import InputError, LayoutError, diagnose_inputs

    expandable = {"on": True, "off": False, None: None}[args.expandable_segments]
    try:  # the inputs before the estimate: a bad file is refused before Bridge is imported
        result = diagnose_inputs(args.inputs, sizes=sizes, total_memory=total, expandable=expandable)
    except (InputError, LayoutError) as error:
        return _fail(str(error))
    if plan_args is not None:
        failed = _beside_the_estimate(result, plan_args, sizes)
        if failed is not None:
            return failed
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.format(), flush=True)
    if args.plot:
        return _plot(result, args.plot, total)
    return 0


def _plan_args(words: list[str]):
    """``--plan``'s words parsed and checked as ``mbx plan`` parses and checks them (``--gpu-memory`` is not needed
    here: a placeholder is given when absent), or the one-line problem."""
    from megatron_bridge_ext.cli import build_parser, plan

    if not any(w in ("--hf-config", "--recipe") or w.startswith(("--hf-config=", "--recipe=")) for w in words):
        return None, "--plan needs the run's config: --plan --hf-config config.json ... or --plan --recipe MODULE:FUNCTION"
    if not any(w == "--gpu-memory" or w.startswith("--gpu-memory=") for w in words):
        words = [*words, "--gpu-memory", "80GiB"]
    try:
        parsed = build_parser().parse_args(["plan", *words])
    except SystemExit:  # argparse has printed mbx plan's usage and the bad option
        return None, "--plan: the options above are not mbx plan's (mbx plan --help lists them)"
    problem = plan.check_args(parsed)
    return (None, f"--plan: {problem}") if problem else (parsed, None)


def _beside_the_estimate(result, plan_args, sizes):
    """Build and estimate the config, place the run in the config's layout, and compare; None, or the exit status."""
    from megatron_bridge_ext.diagnose.collect import LayoutError, place
    from megatron_bridge_ext.diagnose import graph_pools
    from megatron_bridge_ext.diagnose.compare import compare
    from megatron_bridge_ext.diagnose.report import RunDiagnosis
    from megatron_bridge_ext.findings import Refused

    if not isinstance(result, RunDiagnosis) or not result.reports:
        return _fail("--plan: the inputs hold no memory report line to set beside the estimate; give the training log")
    try:
        iterations = sorted({report.iteration for reports in result.reports.values() for report in reports})
        predictions, config_sizes, pools = _estimate(plan_args, iterations)
    except Refused as refused:
        return _fail(f"--plan: {refused.one_line()}")
    stated = {k: v for k, v in sizes.items() if v is not None}
    for name, value in stated.items():
        if config_sizes.get(name) not in (None, value):
            return _fail(f"--{name} {value} contradicts the config of --plan ({name} {config_sizes[name]}). Fix: give "
                         "one of them")
    try:
        place(result, {**config_sizes, **stated}, {name: "--plan's config" for name in config_sizes if name not in stated})
    except LayoutError as error:
        return _fail(f"{error} (the layout of --plan's config)")
    result.comparison = compare(result, predictions)
    result.graph_pools = graph_pools.compare(result, pools)
    return None


def _estimate(plan_args, iterations: list[int]):
    """The predicted report lines of the config at the iterations the log's reports were taken after, the config's
    parallel sizes, and each estimated stage's predicted CUDA-graph pool (the estimate's phases)."""
    import contextlib
    import logging

    from megatron_bridge_ext import logs
    from megatron_bridge_ext.cli import plan_failures
    from megatron_bridge_ext.estimate.memory import estimate
    from megatron_bridge_ext.estimate.phases import predicted_reports
    from megatron_bridge_ext.levers.parallelism.constraints import expert_sizes
    from megatron_bridge_ext.patches.registry import plan_imports
    from megatron_bridge_ext.plan_config import build_config

    plan_failures.say_importing()
    logs.configure(verbose=plan_args.verbose)
    logging.getLogger("megatron.bridge.utils.fusions").setLevel(logging.ERROR)
    with plan_imports(), contextlib.redirect_stdout(sys.stderr):
        built, options = build_config(plan_args)
        est = estimate(built.cfg, **options)
    model = built.cfg.model
    ep, etp = expert_sizes(model)
    sizes = {"tp": model.tensor_model_parallel_size, "pp": model.pipeline_model_parallel_size,
             "cp": model.context_parallel_size or 1, "dp": est.settings.dp, "ep": ep}
    if ep > 1:
        sizes["etp"] = etp
    return predicted_reports(est, iterations), sizes, est.stage_graph_pools


def _plot(result, path: str, total) -> int:
    from megatron_bridge_ext.diagnose import plot

    try:
        plot.draw(result, path, total_memory=total)
    except plot.NothingToDraw as error:
        return _fail(f"--plot {path}: {error}")
    print(f"mbx diagnose: picture written to {path}", file=sys.stderr)
    return 0
