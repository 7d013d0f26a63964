"""``mbx plan``: per-rank memory of a Bridge config before launch, and the first lever that makes it fit.

Parsing and printing only: the checks of the options are :mod:`.plan_inputs` and :mod:`.plan_hf_inputs`, the
config is built by :mod:`megatron_bridge_ext.plan_config`, planned by :mod:`megatron_bridge_ext.planner` and
shown by :mod:`megatron_bridge_ext.render`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings

from megatron_bridge_ext.cli import plan_hf_inputs, plan_inputs
from megatron_bridge_ext.plan_config import LORA_DIM_DEFAULT, build_config, global_batch_problem
from megatron_bridge_ext.render.plan import NOT_MODELLED_STATUS, format_plan, plan_json, settings_line

PLOT_EXTRA = 'pip install "megatron-bridge-ext[plot]"'

PLAN_EXAMPLES = """
mbx plan --hf-config tests/data/qwen3-8b/config.json --tp 2 --seq 8192 --peft lora --dp 4 --gpu-memory 40GiB
mbx plan --recipe megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config --gpu-memory 80GiB --dp 8 \\
    --json model.num_layers=32 model.hidden_size=4096 model.num_attention_heads=32 model.ffn_hidden_size=14336 \\
    model.vocab_size=128256 model.share_embeddings_and_output_weights=false
"""


def add_parser(sub, make_parser) -> None:
    """``mbx plan``'s options; ``make_parser(sub, name, examples, **kwargs)`` adds a subcommand with examples."""
    p = make_parser(
        sub, "plan", PLAN_EXAMPLES,
        help="estimate per-rank memory of a Bridge config (PEFT-aware, measured from the layer code) and walk "
             "the OOM levers in order until one fits",
        description="Input: a Bridge recipe (--recipe MODULE:FUNCTION) or a Hugging Face config.json (--hf-config), "
                    "parallel sizes, sequence, micro-batch and --gpu-memory; Hydra-style OVERRIDES apply last. "
                    "Defaults marked 'recipe' keep the recipe's value with --recipe.")
    p.add_argument("--recipe", help="a Bridge recipe function, MODULE:FUNCTION (default: none; give it, "
                                    "--hf-config, or both)")
    p.add_argument("--hf-config", help="a Hugging Face config.json (read offline); with --recipe, it answers the "
                                       "recipe's read of the model's config from the hub (default: none)")
    p.add_argument("--gpu-memory", metavar="SIZE", required=True,
                   help="device memory per GPU with its unit: 80GiB (2^30 bytes) or 80GB (10^9 bytes); a GPU sold "
                        "as \"80GB\" holds about 80GiB")
    p.add_argument("--tp", type=int, help="tensor parallel size (default: recipe; 1 with --hf-config)")
    p.add_argument("--pp", type=int, help="pipeline parallel size (default: recipe; 1 with --hf-config)")
    p.add_argument("--gpus", type=int, metavar="N",
                   help="the run's world size: DP = N / (TP x PP x CP) (default: the count a recipe's name states, "
                        "e.g. _16gpu_; else from --dp)")
    p.add_argument("--dp", type=int, help="data parallel size, divides the distributed optimizer's states and sets "
                                          "the microbatches of a step (default: from --gpus or the recipe's stated "
                                          "GPU count; 1 with --hf-config alone)")
    p.add_argument("--ep", type=int, help="expert model parallel size of a mixture-of-experts model: divides its "
                                          "experts (default: recipe; 1 with --hf-config)")
    p.add_argument("--etp", type=int, help="expert tensor parallel size: the TP of the expert layers (default: "
                                           "recipe; with --hf-config 1 when EP > 1, as Bridge sets it, else TP)")
    p.add_argument("--seq", type=int, help="sequence length (default: recipe; required with --hf-config alone, whose "
                                           "max_position_embeddings is the longest the model takes, not a training "
                                           "length)")
    p.add_argument("--micro-batch", type=int, help="micro-batch size (default: recipe; 1 with --hf-config)")
    p.add_argument("--global-batch", type=int, help="global batch size, a multiple of micro-batch x DP (default: "
                                                    "recipe; micro-batch x DP x PP with --hf-config)")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when TP > 1, for --hf-config and whenever --tp is given; "
                        "a recipe without --tp keeps its own)")
    p.add_argument("--peft", choices=("lora", "dora", "canonical_lora", "none"),
                   help="Bridge's LoRA, DoRA or CanonicalLoRA on the four linear layers, or none: full fine-tuning "
                        "(default: recipe; full fine-tuning with --hf-config)")
    p.add_argument("--lora-dim", type=int, default=None, help=f"LoRA rank, with --peft (default: "
                                                              f"{LORA_DIM_DEFAULT}, Bridge's default)")
    p.add_argument("--expandable-segments", choices=("on", "off"), default=None,
                   help="the run's allocator setting (default: from the recipe's env_vars; off with --hf-config)")
    p.add_argument("--margin", type=float, default=None,
                   help="share of device memory kept free without expandable segments (default: 0.10; 0.03 with "
                        "them)")
    p.add_argument("--attention", choices=("fused", "local"), default=None,
                   help="fused (flash/cuDNN) or Megatron Core's unfused local attention (default: fused)")
    p.add_argument("--moe-imbalance", type=float, metavar="LOAD",
                   help="mixture-of-experts models: tokens of the most loaded expert over the balanced share "
                        "(tokens x top-k / experts), 1 or more; the traced rank's experts each get that load "
                        "(default: 1.0, a balanced load)")
    p.add_argument("--resume", action="store_true",
                   help="the run resumes from a checkpoint with optimizer state: a phase for its load, and iteration 1 "
                        "with the loaded moments (default: a fresh run)")
    p.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                   help="default: the config's model.transformer_impl")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="the device that prices each option's step time: h100, h200, b200, b300, gb200 or gb300, "
                        "peak rates from NVIDIA's datasheets (default: h100, stated in the output)")
    p.add_argument("--gpu-flops", type=float, metavar="TFLOPS",
                   help="override the dense bf16 peak in TFLOP/s (FP8 scales with it; default: the preset's)")
    p.add_argument("--gpu-hbm", type=float, metavar="TB/S", help="override the HBM bandwidth in TB/s (default: the "
                                                                  "preset's)")
    p.add_argument("--gpu-nvlink", type=float, metavar="GB/S",
                   help="override the NVLink bandwidth per GPU and direction in GB/s (default: the preset's)")
    p.add_argument("--gpu-ib", type=float, metavar="GB/S",
                   help="override the InfiniBand bandwidth per GPU and direction in GB/s (default: the preset's)")
    p.add_argument("--search", action="store_true",
                   help="search every legal layout of the workload on --gpus N (TP, PP, VPP, CP, EP, ETP, DP, SP, "
                        "micro-batch, recompute, distributed optimizer, expandable segments): the fastest that fits and "
                        "the front of peak memory against step time (default: walk the levers from the given layout)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (default: text)")
    p.add_argument("--plot", metavar="FILE",
                   help="draw a stacked bar per option to FILE; with --search, every estimated candidate's peak against its "
                        "step time, the front and the answer (default: no plot; needs matplotlib: "
                        f"{PLOT_EXTRA})")
    p.add_argument("--verbose", action="store_true",
                   help="also show the upstream warnings known to be harmless here (default: filtered; "
                        "docs/tools/plan.md lists them)")
    p.add_argument("--debug", action="store_true",
                   help="let an unexpected error inside the estimate end in its traceback (default: one line)")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDES", help="Hydra-style overrides, e.g. model.seq_length=8192")
    p.set_defaults(func=command)


def command(args) -> int:
    problem = check_args(args)  # before torch, Megatron or the config file's model are touched
    if problem:
        return _fail(problem)
    from megatron_bridge_ext import logs
    from megatron_bridge_ext.cli import plan_failures
    from megatron_bridge_ext.findings import Refused

    plan_failures.say_importing()
    logs.configure(verbose=args.verbose)
    # Chatter that says nothing about the plan: Bridge turning gradient_accumulation_fusion off without
    # TE/Apex (the estimate does that too), transformers on the spelling of config.json's dtype field, which
    # Bridge reads.
    logging.getLogger("megatron.bridge.utils.fusions").setLevel(logging.ERROR)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r".*MimoModelConfig is experimental.*")
    from megatron_bridge_ext.patches.registry import plan_imports

    try:
        # upstream prints while models are built; stdout is the plan's
        with plan_imports(), contextlib.redirect_stdout(sys.stderr), plan_failures.unexpected(args.debug):
            result = _search(args) if args.search else _plan(args)
    except Refused as refused:
        return _fail(refused.one_line())
    except plan_failures.Unexpected as failure:
        print(f"mbx plan: {failure}", file=sys.stderr)
        return plan_failures.UNEXPECTED_STATUS
    if args.search:
        return _search_report(result, args)
    text = _report(result, args)
    print(text, flush=True)  # before the plot: a failure there must not lose the plan
    if args.plot:
        return _plot(result, args) or (0 if result.baseline is not None else NOT_MODELLED_STATUS)
    return 0 if result.baseline is not None else NOT_MODELLED_STATUS


def _report(result, args) -> str:
    """The plan as JSON (``--json``) or text."""
    if args.json:
        return plan_json(result, gpu_defaulted=args.gpu is None)
    return format_plan(result, command_line=" ".join(["mbx plan", *sys.argv[2:]]) if sys.argv[1:2] == ["plan"]
                       else None, peft_defaulted=_peft_defaulted(args), gpu_defaulted=args.gpu is None)


def _peft_defaulted(args) -> bool:
    return args.peft is None and bool(args.hf_config) and not args.recipe


def _plot(result, args) -> int:
    """Write ``--plot`` after the plan is printed; 0, or 2 with one line when it cannot be written."""
    from megatron_bridge_ext.render import plan_plot

    if result.baseline is None:
        print(f"mbx plan: no plot written to {args.plot}: its bars are our estimate's, which does not model this "
              "config", file=sys.stderr)
        return 0
    try:
        plan_plot.plot(result, args.plot, settings_line(result.baseline.settings,
                                                        peft_defaulted=_peft_defaulted(args)))
    except (OSError, ValueError) as error:  # matplotlib: an unknown file extension is a ValueError
        return _fail(f"--plot: {args.plot} was not written ({error}). Fix: give a writable .png, .pdf or .svg path "
                     "(the plan above stands)")
    print(f"mbx plan: plot written to {args.plot}", file=sys.stderr)
    return 0


def _fail(line: str) -> int:
    print(f"mbx plan: {line}", file=sys.stderr)
    return 2


def check_args(args) -> str | None:
    """The first problem of the arguments as one line, or None; reads --hf-config's JSON, imports nothing heavy.

    Converts ``args.gpu_memory`` to bytes. The parallel layout of a recipe is checked once the recipe is
    built (its sizes are not known before).
    """
    from megatron_bridge_ext.sizes import SizeError, parse_size

    if not (args.recipe or args.hf_config):
        return _bad("--recipe/--hf-config", "give --recipe MODULE:FUNCTION or --hf-config FILE",
                    "add one (both: the recipe, with its Hugging Face config read from the file)").text()
    try:
        args.gpu_memory = parse_size(args.gpu_memory, "--gpu-memory")
    except SizeError as error:
        return str(error)
    problem = (plan_inputs.override_problem(args.overrides) or plan_inputs.conflict_problem(args)
               or plan_inputs.recipe_module_problem(args.recipe) or plan_inputs.plot_problem(args.plot)
               or plan_inputs.number_problem(args) or _matplotlib_problem(args.plot)
               or plan_inputs.lora_dim_problem(args) or plan_inputs.gpu_problem(args)
               or plan_inputs.search_problem(args)
               or global_batch_problem(args.global_batch, args.micro_batch or (1 if args.hf_config else None),
                                       args.dp or (1 if args.hf_config else None), setting="--global-batch"))
    if problem is None and args.hf_config:
        problem = plan_hf_inputs.hf_problem(args)
    return problem.text() if problem else None


def _bad(setting: str, message: str, fix: str):
    from megatron_bridge_ext.findings import ERROR, Finding

    return Finding("bad_input", ERROR, setting, message, fix)


def _matplotlib_problem(plot):
    """--plot without matplotlib."""
    if plot and not _have_matplotlib():
        return _bad("--plot", "needs matplotlib", PLOT_EXTRA)
    return None


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _plan(args):
    from megatron_bridge_ext import planner

    built, options = build_config(args)
    expandable = None if args.recipe else False
    if args.expandable_segments is not None:
        expandable = args.expandable_segments == "on"
    result = planner.plan(built.cfg, gpu_memory=args.gpu_memory, expandable_segments=expandable,
                          estimate_options=options, peft_overrides=built.peft_overrides, gpu=args.device,
                          **({"margin": args.margin} if args.margin is not None else {}))
    result.notes = built.notes + [n for n in [plan_inputs.seq_note(built.cfg.model.seq_length, args.hf_config)] if n]
    return result



def _search(args):
    """``--search``: the config as given estimated, then every legal candidate of its workload
    (:mod:`megatron_bridge_ext.search.walk`)."""
    built, options = build_config(args)
    return search_built(args, built.cfg, options)


def search_built(args, cfg, options: dict):
    """:func:`_search` on the config ``build_config`` built (``options``: the estimate's)."""
    from megatron_bridge_ext import planner
    from megatron_bridge_ext.estimate import estimate
    from megatron_bridge_ext.levers.lora_input.config import shard_local_wanted
    from megatron_bridge_ext.search import walk

    base = estimate(cfg, **options)
    world = args.gpus  # required with --search (plan_inputs.search_problem)
    expandable = args.expandable_segments == "on"
    margin = args.margin if args.margin is not None else planner.MARGIN
    usable = int(args.gpu_memory * (1 - (planner.EXPANDABLE_MARGIN if expandable else margin)))
    return walk.search(cfg, base, world=world, usable=usable,
                       usable_expandable=int(args.gpu_memory * (1 - planner.EXPANDABLE_MARGIN)),
                       expandable_on=expandable, gpu=args.device, estimate_options=options,
                       shard_local=shard_local_wanted(cfg))


def _search_report(result, args) -> int:
    from megatron_bridge_ext.search import report

    print(report.as_json(result) if args.json else report.as_text(result), flush=True)
    if args.plot:
        try:
            report.plot(result, args.plot)
        except (OSError, ValueError) as error:
            return _fail(f"--plot: {args.plot} was not written ({error})")
        print(f"mbx plan: plot written to {args.plot}", file=sys.stderr)
    return 0 if result.answer else 1
