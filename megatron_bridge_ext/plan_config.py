"""The config ``mbx plan``'s options and overrides describe: built with the estimate's builders, checked as
built, and the estimate's options. ``mbx plan`` and ``mbx diagnose --plan`` build the same.

``args`` is ``mbx plan``'s parsed and checked namespace (``megatron_bridge_ext.cli.plan.check_args``); this
module reads it and parses nothing. The rules here that also run before the build (an override that sets a
field, the global batch against micro-batch x DP, an expert-only flag) are the ones the command's checks
call, so a flag and the built config are refused in the same words.
"""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding

LORA_DIM_DEFAULT = 32
"""``--lora-dim`` when not given (Bridge's LoRA default)."""
EXPERT_FIELDS = {"ep": "model.expert_model_parallel_size", "etp": "model.expert_tensor_parallel_size",
                 "tp": "model.tensor_model_parallel_size", "cp": "model.context_parallel_size"}
"""The model fields of the sizes the expert-parallel rules read, as overrides name them."""
EXPERT_ONLY_FLAGS = {"etp": "--etp", "moe_imbalance": "--moe-imbalance"}
"""Flags that act on a mixture-of-experts model only (``--ep`` has the expert layout's own rule)."""


def build_config(args):
    """The config ``mbx plan``'s options and overrides describe, checked as built, and the estimate's options
    (``mbx diagnose --plan`` builds the same)."""
    from megatron_bridge_ext.estimate import configs
    from megatron_bridge_ext.findings import Refused

    rank = args.lora_dim or LORA_DIM_DEFAULT
    layout = configs.Layout(tp=args.tp, pp=args.pp, dp=args.dp, gpus=getattr(args, "gpus", None), ep=args.ep,
                            etp=args.etp, seq=args.seq,
                            micro_batch=args.micro_batch, global_batch=args.global_batch, sequence_parallel=args.sp,
                            peft=args.peft, lora_dim=rank, lora_alpha=rank)
    built = configs.build(layout, args.overrides, recipe=args.recipe, hf_config=args.hf_config)
    _check_global_batch(built.cfg, args)
    dp_from = "--dp" if args.dp or not (getattr(args, "gpus", None) or args.recipe) else "--gpus"
    _check_experts(built.cfg, names={"ep": written(args, "ep"), "etp": written(args, "etp"), "dp": dp_from})
    problem = built_problem(built.cfg, args)
    if problem:
        raise Refused("mbx plan input", [problem])
    options = {k: v for k, v in (("attention", args.attention), ("transformer_impl", args.transformer_impl),
                                 ("moe_imbalance", args.moe_imbalance),
                                 ("resume", getattr(args, "resume", False))) if v}
    return built, options


def _bad(setting: str, message: str, fix: str):
    return Finding("bad_input", ERROR, setting, message, fix)


def overridden(overrides, *keys: str) -> bool:
    """Whether an override sets one of ``keys`` (``model.seq_length=...``, ``+model.seq_length=...``)."""
    return any(o.lstrip("+~").split("=", 1)[0] in keys for o in overrides or ())


def written(args, name: str) -> str:
    """The setting to name for ``name``: its override when one sets it (overrides win), its model field when a
    recipe may have set it, else its flag."""
    if overridden(args.overrides, EXPERT_FIELDS[name]) or (args.recipe and getattr(args, name) is None):
        return EXPERT_FIELDS[name]
    return f"--{name}"


def global_batch_problem(global_batch, micro_batch, dp, *, setting: str):
    """A global batch that a step cannot split into whole microbatches on every replica, or None."""
    if not global_batch or not micro_batch or not dp or global_batch % (micro_batch * dp) == 0:
        return None
    unit = micro_batch * dp
    return _bad(setting, f"{global_batch} is not a multiple of micro-batch x DP = {micro_batch} x {dp} = {unit} "
                         "(each step runs whole microbatches on every data-parallel replica)",
                f"give a multiple of {unit}, e.g. {setting}{' ' if setting.startswith('--') else '='}"
                f"{unit * max(1, round(global_batch / unit))}")


def _check_global_batch(cfg, args) -> None:
    """The built config's global batch against its micro-batch and DP (a recipe's or an override's). Where the user
    changed the micro-batch and left the recipe's global batch, the micro-batch is the setting named."""
    from megatron_bridge_ext.findings import Refused

    global_batch, micro_batch = cfg.train.global_batch_size, cfg.train.micro_batch_size
    dp = getattr(cfg, "data_parallel_size", None)
    problem = global_batch_problem(global_batch, micro_batch, dp, setting="train.global_batch_size")
    if problem is None:
        return
    gave_global = args.global_batch is not None or overridden(args.overrides, "train.global_batch_size")
    micro = "--micro-batch" if args.micro_batch is not None else (
        "train.micro_batch_size" if overridden(args.overrides, "train.micro_batch_size") else None)
    if micro and not gave_global:
        fits = sorted((m for m in range(1, global_batch // dp + 1) if global_batch % (m * dp) == 0),
                      key=lambda m: (abs(m - micro_batch), m))[:2]  # the two nearest the one given
        problem = _bad(micro, f"{micro_batch} with DP {dp} does not divide the recipe's global batch of "
                              f"{global_batch} sequences (each step runs whole microbatches on every data-parallel "
                              "replica)", f"give a micro-batch that divides {global_batch} / DP, e.g. "
                                          f"{' or '.join(map(str, fits))}, or a global batch as well "
                                          "(train.global_batch_size)")
    raise Refused("mbx plan input", [problem])


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


def expert_flag_problem(args, experts) -> Optional[Finding]:
    """``--etp`` or ``--moe-imbalance`` on a model without experts (``experts`` 0 or None), refused by name as
    ``--ep`` is."""
    if experts:
        return None
    for name, flag in EXPERT_ONLY_FLAGS.items():
        if getattr(args, name, None) is not None:
            return _bad(flag, "acts on the experts of a mixture-of-experts model, and this one has no experts",
                        f"drop {flag}")
    return None


def built_problem(cfg, args) -> Optional[Finding]:
    """What the built config cannot be planned with: a recipe's dense model given an expert-only flag, or a
    vocabulary size the recipe leaves to its tokenizer."""
    model = cfg.model
    problem = expert_flag_problem(args, getattr(model, "num_moe_experts", None))
    if problem:
        return problem
    problem = _recipe_lora_dim_problem(cfg, args)
    if problem:
        return problem
    if model.sequence_parallel and model.tensor_model_parallel_size <= 1:  # --sp (the build turns a config's off)
        return _bad("--sp", f"turns sequence parallelism on with TP={model.tensor_model_parallel_size}: Megatron Core "
                    "refuses it (\"Cannot use sequence parallelism without tensor parallelism\", "
                    "model_parallel_config.py L502-504)", "give --tp 2 or more, or --no-sp")
    data_seq = getattr(getattr(cfg, "dataset", None), "seq_length", None)
    if isinstance(data_seq, int) and data_seq != model.seq_length:
        return _bad("dataset.seq_length", f"is {data_seq} and model.seq_length is {model.seq_length}: Bridge requires "
                    "them to match (ConfigContainer.validate, training/config.py L1503-1509)",
                    f"give the training length once with --seq, which sets both: --seq {data_seq} (the dataset's) "
                    f"or --seq {model.seq_length} (the model's)")
    if getattr(model, "vocab_size", 1) is None:
        return _bad("model.vocab_size", f"is unset: the recipe leaves it to the tokenizer "
                    f"({_tokenizer_named(cfg)}), which Bridge reads only when training starts",
                    "give the tokenizer's vocabulary size, e.g. model.vocab_size=131072")
    return None


def _recipe_lora_dim_problem(cfg, args) -> Optional[Finding]:
    """``--lora-dim`` on a recipe without ``--peft``: the rank of adapters ``--peft`` would add, where the recipe
    builds none (every parameter trained) or builds its own PEFT object, which Bridge keeps over overrides."""
    if getattr(args, "lora_dim", None) is None or getattr(args, "peft", None) is not None:
        return None
    peft = cfg.peft
    if peft is None:
        return _bad("--lora-dim", "sets the rank of the adapters --peft adds, and the recipe builds no PEFT (every "
                    "parameter trained)", "add --peft lora (or dora, canonical_lora), or drop --lora-dim")
    return _bad("--lora-dim", f"sets the rank of the adapters --peft adds, and the recipe builds its own "
                f"{type(peft).__name__} (dim {getattr(peft, 'dim', '?')}) in Python, which Bridge keeps over "
                "overrides", "give --peft lora --lora-dim N to estimate Bridge's LoRA at that rank in its place, or "
                "change the dim in the recipe")


def _tokenizer_named(cfg) -> str:
    tokenizer = getattr(cfg, "tokenizer", None)
    for attr in ("tokenizer_model", "hf_tokenizer_path", "tokenizer_type"):
        value = getattr(tokenizer, attr, None)
        if value:
            return f"cfg.tokenizer.{attr}={value}"
    return "cfg.tokenizer"
