"""``mbx plan``: per-rank memory of a Bridge config before launch, and the first lever that makes it fit."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import textwrap
import warnings

from megatron_bridge_ext.cli import plan_inputs
from megatron_bridge_ext.sizes import gib, sold_as_note

PLOT_EXTRA = 'pip install "megatron-bridge-ext[plot]"'


PLAN_EXAMPLES = """
mbx plan --hf-config tests/data/qwen3-8b/config.json --tp 2 --seq 8192 --peft lora --dp 4 --gpu-memory 40GiB
mbx plan --recipe megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config --gpu-memory 80GiB --dp 8 \\
    --json model.num_layers=32 model.hidden_size=4096 model.num_attention_heads=32 model.ffn_hidden_size=14336 \\
    model.vocab_size=128256 model.share_embeddings_and_output_weights=false
"""
POSITIVE_INTS = {"tp": 2, "pp": 2, "dp": 8, "ep": 4, "etp": 1, "seq": 4096, "micro_batch": 1, "global_batch": 128,
                 "lora_dim": 32}
"""The whole-number options, each 1 or more (checked before anything is imported), with an example value."""
EXPERT_FIELDS = {"ep": "model.expert_model_parallel_size", "etp": "model.expert_tensor_parallel_size",
                 "tp": "model.tensor_model_parallel_size", "cp": "model.context_parallel_size"}
"""The model fields of the sizes the expert-parallel rules read, as overrides name them."""
HF_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where a Hugging Face config.json states its number of routed experts (Qwen-MoE, Mixtral/GPT-OSS, DeepSeek)."""
GPU_OVERRIDES = {"gpu_flops": ("bf16_flops", 1e12, 989.5), "gpu_hbm": ("hbm", 1e12, 3.35),
                 "gpu_nvlink": ("nvlink", 1e9, 450), "gpu_ib": ("ib", 1e9, 50)}
"""The device overrides: the :class:`~megatron_bridge_ext.levers.steptime.Gpu` field each sets, its unit in
the flag, and an example value (H100 SXM's)."""
NOT_MODELLED_STATUS = 3
"""Exit status of a plan printed without our estimate (the config is fine, but no fits/does-not-fit verdict)."""


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
    p.add_argument("--dp", type=int, help="data parallel size, divides the distributed optimizer's states "
                                          "(default: recipe, else 1)")
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
                                                              f"{plan_inputs.LORA_DIM_DEFAULT}, Bridge's default)")
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
    p.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                   help="default: the config's model.transformer_impl")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="the device that prices each option's step time with a roofline model: h100, h200 or b200, "
                        "SXM, peak rates from NVIDIA's datasheets (default: h100, stated in the output)")
    p.add_argument("--gpu-flops", type=float, metavar="TFLOPS",
                   help="override the dense bf16 peak in TFLOP/s (FP8 scales with it; default: the preset's)")
    p.add_argument("--gpu-hbm", type=float, metavar="TB/S", help="override the HBM bandwidth in TB/s (default: the "
                                                                  "preset's)")
    p.add_argument("--gpu-nvlink", type=float, metavar="GB/S",
                   help="override the NVLink bandwidth per GPU and direction in GB/s (default: the preset's)")
    p.add_argument("--gpu-ib", type=float, metavar="GB/S",
                   help="override the InfiniBand bandwidth per GPU and direction in GB/s (default: the preset's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (default: text)")
    p.add_argument("--plot", metavar="FILE",
                   help=f"draw a stacked bar per option to FILE (default: no plot; needs matplotlib: {PLOT_EXTRA})")
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
            result = _plan(args)
    except Refused as refused:
        return _fail(refused.one_line())
    except plan_failures.Unexpected as failure:
        print(f"mbx plan: {failure}", file=sys.stderr)
        return plan_failures.UNEXPECTED_STATUS
    text = _report(result, args)
    print(text, flush=True)  # before the plot: a failure there must not lose the plan
    if args.plot:
        return _plot(result, args) or (0 if result.baseline is not None else NOT_MODELLED_STATUS)
    return 0 if result.baseline is not None else NOT_MODELLED_STATUS


def _report(result, args) -> str:
    """The plan as JSON (``--json``) or text."""
    if args.json:
        report = result.as_dict()
        report["gpu"]["defaulted"] = args.gpu is None
        return json.dumps(report, indent=2, default=str)
    return format_plan(result, command_line=" ".join(["mbx plan", *sys.argv[2:]]) if sys.argv[1:2] == ["plan"]
                       else None, peft_defaulted=_peft_defaulted(args), gpu_defaulted=args.gpu is None)


def _peft_defaulted(args) -> bool:
    return args.peft is None and bool(args.hf_config) and not args.recipe


def _plot(result, args) -> int:
    """Write ``--plot`` after the plan is printed; 0, or 2 with one line when it cannot be written."""
    from megatron_bridge_ext.cli import plan_plot

    if result.baseline is None:
        print(f"mbx plan: no plot written to {args.plot}: its bars are our estimate's, which does not model this "
              "config", file=sys.stderr)
        return 0
    try:
        plan_plot.plot(result, args.plot, _settings_line(result.baseline.settings,
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
               or _number_problem(args) or plan_inputs.lora_dim_problem(args) or _gpu_problem(args)
               or _global_batch_problem(args.global_batch, args.micro_batch or (1 if args.hf_config else None),
                                        args.dp or (1 if args.hf_config else None), setting="--global-batch"))
    if problem is None and args.hf_config:
        problem = _hf_problem(args)
    return problem.text() if problem else None


def _bad(setting: str, message: str, fix: str):
    from megatron_bridge_ext.findings import ERROR, Finding

    return Finding("bad_input", ERROR, setting, message, fix)


def _number_problem(args):
    """A whole-number option below 1, a margin outside [0, 1), or --plot without matplotlib."""
    for name, example in POSITIVE_INTS.items():
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            return _bad(flag, f"{value} is not a whole number of 1 or more", f"give e.g. {flag} {example}")
    if args.moe_imbalance is not None:
        from megatron_bridge_ext.estimate.configs import imbalance_problem

        problem = imbalance_problem(args.moe_imbalance, "--moe-imbalance")
        if problem:
            return problem
    if args.margin is not None and not 0 <= args.margin < 1:
        return _bad("--margin", f"{args.margin} is not a share between 0 and 1", "give e.g. 0.10")
    if args.plot and not _have_matplotlib():
        return _bad("--plot", "needs matplotlib", PLOT_EXTRA)
    return None


def _gpu_problem(args):
    """An unknown --gpu or a device override that is not a positive number; else sets ``args.device``."""
    from megatron_bridge_ext.levers import steptime

    overrides = {}
    for name, (field, unit, example) in GPU_OVERRIDES.items():
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if value is not None and not value > 0:
            return _bad(flag, f"{value} is not a positive rate", f"give e.g. {flag} {example}")
        overrides[field] = None if value is None else value * unit
    try:
        args.device = steptime.gpu(args.gpu or steptime.DEFAULT_GPU, **overrides)
    except steptime.UnknownGpu as error:
        return _bad("--gpu", str(error), f"give one of them, e.g. --gpu {steptime.DEFAULT_GPU}")
    return None


def _overridden(overrides, *keys: str) -> bool:
    """Whether an override sets one of ``keys`` (``model.seq_length=...``, ``+model.seq_length=...``)."""
    return any(o.lstrip("+~").split("=", 1)[0] in keys for o in overrides or ())


def _global_batch_problem(global_batch, micro_batch, dp, *, setting: str):
    """A global batch that a step cannot split into whole microbatches on every replica, or None."""
    if not global_batch or not micro_batch or not dp or global_batch % (micro_batch * dp) == 0:
        return None
    unit = micro_batch * dp
    return _bad(setting, f"{global_batch} is not a multiple of micro-batch x DP = {micro_batch} x {dp} = {unit} "
                         "(each step runs whole microbatches on every data-parallel replica)",
                f"give a multiple of {unit}, e.g. {setting}{' ' if setting.startswith('--') else '='}"
                f"{unit * max(1, round(global_batch / unit))}")


def _hf_problem(args):
    """--seq, TP and PP against config.json (heads, query groups, layers) before the model is built.

    The rules and wording are the estimate's ``parallel_problems``, which checks the built model
    again; fields that overrides set are left to that check.
    """
    from megatron_bridge_ext.estimate.configs import read_hf_config
    from megatron_bridge_ext.findings import Refused

    try:
        data = read_hf_config(args.hf_config)
    except Refused as refused:
        return refused.findings[0]
    shape = _hf_shape_problem(args, data)
    if shape is None and not _overridden(args.overrides, "model.num_moe_experts"):  # config.json's experts stand
        shape = plan_inputs.expert_flag_problem(args, _hf_experts(data))
    shape = shape or _hf_expert_problem(args, data)
    if shape:
        return shape
    if args.seq is None and not args.recipe and not _overridden(args.overrides, "model.seq_length"):
        return _bad("--seq", "required with --hf-config (config.json's max_position_embeddings is the longest "
                             "sequence the model takes, not the training length)",
                    "give the training length, e.g. --seq 4096")
    tp, pp = args.tp or 1, args.pp or 1
    heads, layers = data["num_attention_heads"], data["num_hidden_layers"]
    groups = data.get("num_key_value_heads") or heads
    sp = args.sp if args.sp is not None else tp > 1
    checks = [
        ("model.num_attention_heads", heads % tp, "model.tensor_model_parallel_size",
         f"TP={tp} does not divide the {heads} attention heads"),
        ("model.num_query_groups", groups % tp, "model.tensor_model_parallel_size",
         f"TP={tp} does not divide the {groups} query groups"),
        ("model.seq_length", sp and tp > 1 and args.seq and args.seq % tp, "model.seq_length",
         f"sequence {args.seq} is not divisible by TP={tp} (sequence parallelism splits it)"),
        ("model.num_layers", layers % pp, "model.pipeline_model_parallel_size",
         f"PP={pp} does not divide the {layers} layers"),
    ]
    for field, failed, setting, message in checks:
        if failed and not _overridden(args.overrides, field, setting):
            return _bad(setting, message, "choose sizes that divide it")
    return None


def _override_int(overrides, key: str):
    """The value an override gives ``key`` (the last one wins, as in Bridge's parser) if it is a whole number,
    else None (a value that is not one is left to Bridge's parser)."""
    values = [o.split("=", 1)[1] for o in overrides or () if "=" in o and o.lstrip("+~").split("=", 1)[0] == key]
    try:
        return int(values[-1]) if values else None
    except ValueError:
        return None


def _expert_sizes(args) -> dict:
    """EP, ETP, TP and CP as the run will have them where they are known before the build (overrides win)."""
    sizes = {"ep": args.ep, "etp": args.etp, "tp": args.tp, "cp": None}
    for name, field in EXPERT_FIELDS.items():
        value = _override_int(args.overrides, field)
        if value is not None:
            sizes[name] = value
    return sizes


def _hf_experts(data: dict):
    return next((data[key] for key in HF_EXPERT_KEYS if data.get(key)), None)


def _hf_expert_problem(args, data: dict):
    """The expert-parallel rules on config.json's experts and the sizes known before the build."""
    if _overridden(args.overrides, "model.num_moe_experts"):
        return None
    sizes = _expert_sizes(args)
    alone = not args.recipe  # a recipe's own sizes are known after the build (checked then)
    if sizes["ep"] is None and not alone:
        return None
    from megatron_bridge_ext.levers.parallelism.constraints import expert_layout_problem

    names = {"ep": _written(args, "ep"), "etp": _written(args, "etp"), "dp": "--dp"}
    return expert_layout_problem(ep=sizes["ep"] or 1, etp=sizes["etp"], tp=sizes["tp"] or 1, cp=sizes["cp"] or 1,
                          dp=(args.dp or 1) if alone else None, experts=_hf_experts(data), names=names)


def _hf_shape_problem(args, data: dict):
    """A shape field of config.json below 1 (the estimate's rule), unless an override sets the field."""
    from megatron_bridge_ext.estimate.configs import SHAPE_FIELDS, bad_shape, shape_fix

    for field, key in SHAPE_FIELDS.items():
        value = data.get(key)
        if bad_shape(value) and not _overridden(args.overrides, f"model.{field}"):
            return _bad(f"--hf-config {args.hf_config}", f"{key} is {value!r}",
                        f"{shape_fix(key)} in the file, or override model.{field}")
    return None


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def build_config(args):
    """The config ``mbx plan``'s options and overrides describe, checked as built, and the estimate's options
    (``mbx diagnose --plan`` builds the same)."""
    from megatron_bridge_ext.estimate import configs
    from megatron_bridge_ext.findings import Refused

    rank = args.lora_dim or plan_inputs.LORA_DIM_DEFAULT
    layout = configs.Layout(tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, etp=args.etp, seq=args.seq,
                            micro_batch=args.micro_batch, global_batch=args.global_batch, sequence_parallel=args.sp,
                            peft=args.peft, lora_dim=rank, lora_alpha=rank)
    built = configs.build(layout, args.overrides, recipe=args.recipe, hf_config=args.hf_config)
    _check_global_batch(built.cfg)
    _check_experts(built.cfg, names={"ep": _written(args, "ep"), "etp": _written(args, "etp"), "dp": "--dp"})
    problem = plan_inputs.built_problem(built.cfg, args)
    if problem:
        raise Refused("mbx plan input", [problem])
    options = {k: v for k, v in (("attention", args.attention), ("transformer_impl", args.transformer_impl),
                                 ("moe_imbalance", args.moe_imbalance)) if v}
    return built, options


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


def _check_global_batch(cfg) -> None:
    """The built config's global batch against its micro-batch and DP (a recipe's or an override's)."""
    from megatron_bridge_ext.findings import Refused

    problem = _global_batch_problem(cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                    getattr(cfg, "data_parallel_size", None), setting="train.global_batch_size")
    if problem:
        raise Refused("mbx plan input", [problem])


def _written(args, name: str) -> str:
    """The setting to name for ``name``: its override when one sets it (overrides win), its model field when a
    recipe may have set it, else its flag."""
    if _overridden(args.overrides, EXPERT_FIELDS[name]) or (args.recipe and getattr(args, name) is None):
        return EXPERT_FIELDS[name]
    return f"--{name}"


def _check_experts(cfg, *, names: dict) -> None:
    """The built config's expert-parallel layout (a recipe's, a flag's or an override's) against Core's rules."""
    from megatron_bridge_ext.findings import Refused
    from megatron_bridge_ext.levers.parallelism.constraints import expert_layout_problem

    model = cfg.model
    problem = expert_layout_problem(ep=getattr(model, "expert_model_parallel_size", 1) or 1,
                             etp=getattr(model, "expert_tensor_parallel_size", None),
                             tp=model.tensor_model_parallel_size, cp=model.context_parallel_size or 1,
                             dp=getattr(cfg, "data_parallel_size", None),
                             experts=getattr(model, "num_moe_experts", None),
                             bias=bool(getattr(model, "add_bias_linear", False)), names=names)
    if problem:
        raise Refused("mbx plan input", [problem])


def _settings_line(s: dict, *, peft_defaulted: bool = False) -> str:
    """The config in one line; ``peft_defaulted``: no --peft was given, so say that full fine-tuning is the default."""
    kind = {"dora": "DoRA", "canonical_lora": "CanonicalLoRA"}.get(s.peft and s.peft.kind, "LoRA")
    if s.peft:
        peft = (f"{kind} r={s.peft.lora_dim} on {','.join(s.peft.lora_targets)}, "
                f"sequence_parallel_input_strategy={s.peft.sequence_parallel_input_strategy}")
    else:
        peft = "full fine-tuning" + (" (the default; --peft lora for LoRA)" if peft_defaulted else "")
    recompute = s.recompute_granularity or "none"
    if recompute == "selective":
        recompute += f" {list(s.recompute_modules)}"
    vpp = f" VPP={s.vpp}" if s.vpp else ""
    return (f"TP={s.tp} PP={s.pp}{vpp}{_experts_sizes(s)} "
            f"DP={s.dp} SP={'on' if s.sequence_parallel else 'off'}, seq {s.seq_length}, micro-batch "
            f"{s.micro_batch}, {s.num_microbatches} microbatch(es)/step, {_precision(s)}, {peft}, recompute "
            f"{recompute}, attention {s.attention}, {s.transformer_impl}{_hybrid_layers(s)}{_experts_load(s)}")


def _precision(s: dict) -> str:
    """The parameters' dtype, and the FP8 recipe when the linears run in FP8."""
    return f"{s.dtype} with {s.fp8}" if s.fp8 else s.dtype


def _hybrid_layers(s: dict) -> str:
    layers = s.hybrid and s.hybrid.layers
    return (", hybrid: " + ", ".join(f"{n} {name}" for name, n in layers.items())) if layers else ""


def _experts_sizes(s: dict) -> str:
    return f" EP={s.moe.ep} ETP={s.moe.etp}" if s.moe else ""


def _experts_load(s: dict) -> str:
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
    lines += [f"config: {_settings_line(est.settings, peft_defaulted=peft_defaulted)}"
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
    where = ("iteration 1 at the first optimizer step" if est.peak_phase.name == phases.FIRST_STEP
             else "iteration 2 at the steady state")
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
    default = "; the default, --gpu h200|b200 to change" if gpu_defaulted else ""
    terms = ", ".join(f"{name.replace('_', ' ')} {seconds:.3f}" for name, seconds in vars(t).items())
    return [_wrap(f"step time (roofline, {g.name}: {g.bf16_flops / 1e12:,.1f} TFLOP/s dense bf16 at 100% of peak, "
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
        return ["answer: no combination of the levers fits; more GPUs, a shorter sequence or a smaller micro-batch "
                "are left"]
    flags = ", ".join(f"{k}={v!r}" for k, v in chosen.flags.items())
    lines = [f"answer: step {chosen.step} ({chosen.label}), peak {gib(chosen.peak_bytes)}, step time {_time(chosen)}",
             f"  MemoryConfig({flags})",
             f"  overrides: {' '.join(chosen.overrides) or '(none)'}"]
    if chosen.peft_note:
        lines.append(f"  {chosen.peft_note}")
    if chosen.flags.get("expandable_segments"):
        lines.append("  allocator: launch with `mbx run -- torchrun ...` or call megatron_bridge_ext.init() first")
    return lines


def _wrap(text: str, indent: str = "  - ") -> str:
    return textwrap.fill(text, width=120, initial_indent=indent, subsequent_indent="    ")


def _indent(text: str) -> str:
    return textwrap.indent(text, "  ")
