"""``mbx plan --hf-config``'s checks of config.json before the model is built: its shape fields, TP, PP and
the sequence against its heads, query groups and layers, EP and ETP against its experts.

Each returns one :class:`~megatron_bridge_ext.findings.Finding` (the first problem) or None and imports
neither torch nor Bridge; a field an override sets is left to the checks of the built model, which say
the same in the same words (the estimate's ``parallel_problems``, :mod:`megatron_bridge_ext.plan_config`).
"""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding
from megatron_bridge_ext.plan_config import EXPERT_FIELDS, expert_flag_problem, overridden, written

HF_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where a Hugging Face config.json states its number of routed experts (Qwen-MoE, Mixtral/GPT-OSS, DeepSeek)."""


def _bad(setting: str, message: str, fix: str) -> Finding:
    return Finding("bad_input", ERROR, setting, message, fix)


def hf_problem(args):
    """--seq, TP and PP against config.json (heads, query groups, layers) before the model is built.

    The rules and wording are the estimate's ``parallel_problems``, which checks the built model
    again; fields that overrides set are left to that check.
    """
    from megatron_bridge_ext.estimate.configs import read_hf_config, text_fields
    from megatron_bridge_ext.findings import Refused

    try:
        data = text_fields(read_hf_config(args.hf_config))
    except Refused as refused:
        return refused.findings[0]
    shape = _hf_shape_problem(args, data)
    if shape is None and not overridden(args.overrides, "model.num_moe_experts"):  # config.json's experts stand
        shape = expert_flag_problem(args, _hf_experts(data))
    shape = shape or _hf_expert_problem(args, data)
    if shape:
        return shape
    if args.seq is None and not args.recipe and not overridden(args.overrides, "model.seq_length"):
        return _bad("--seq", "required with --hf-config (config.json's max_position_embeddings is the longest "
                             "sequence the model takes, not the training length)",
                    "give the training length, e.g. --seq 4096")
    tp, pp = args.tp or 1, args.pp or 1
    heads, layers = data["num_attention_heads"], data.get("num_hidden_layers")  # or a hybrid pattern's length
    groups = data.get("num_key_value_heads") or heads
    sp = args.sp if args.sp is not None else tp > 1
    from megatron_bridge_ext.estimate.pipeline import UNEVEN_FIX, indivisible

    divide = "choose sizes that divide it"
    checks = [
        ("model.num_attention_heads", heads % tp, "model.tensor_model_parallel_size",
         f"TP={tp} does not divide the {heads} attention heads", divide),
        ("model.num_query_groups", groups % tp and tp % groups, "model.tensor_model_parallel_size",
         f"TP={tp} neither divides the {groups} query groups nor is a multiple of them (transformer_config.py "
         "L1338-1345; with TP a multiple, Megatron Core gives each rank one key/value head)", divide),
        ("model.seq_length", sp and tp > 1 and args.seq and args.seq % tp, "model.seq_length",
         f"sequence {args.seq} is not divisible by TP={tp} (sequence parallelism splits it)", divide),
        ("model.num_layers", isinstance(layers, int) and layers % pp and not _split_elsewhere(args),
         "model.pipeline_model_parallel_size", indivisible(pp, layers), UNEVEN_FIX),
    ]
    for field, failed, setting, message, fix in checks:
        if failed and not overridden(args.overrides, field, setting):
            return _bad(setting, message, fix)
    return None


SPLIT_FIELDS = ("model.pipeline_model_parallel_layout", "model.account_for_embedding_in_pipeline_split",
                "model.account_for_loss_in_pipeline_split", "model.num_layers_in_first_pipeline_stage",
                "model.num_layers_in_last_pipeline_stage")
"""The fields that split the layers over the stages otherwise than evenly: set by a recipe or an override, the split
is left to the estimate's check of the built model (:func:`megatron_bridge_ext.estimate.pipeline.split_problems`)."""


def _split_elsewhere(args) -> bool:
    return bool(args.recipe) or any(overridden(args.overrides, field) for field in SPLIT_FIELDS)


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
    if overridden(args.overrides, "model.num_moe_experts"):
        return None
    sizes = _expert_sizes(args)
    alone = not args.recipe  # a recipe's own sizes are known after the build (checked then)
    if sizes["ep"] is None and not alone:
        return None
    from megatron_bridge_ext.levers.parallelism.constraints import expert_layout_problem

    names = {"ep": written(args, "ep"), "etp": written(args, "etp"), "dp": "--dp"}
    return expert_layout_problem(ep=sizes["ep"] or 1, etp=sizes["etp"], tp=sizes["tp"] or 1, cp=sizes["cp"] or 1,
                          dp=_dp_before_build(args) if alone else None, experts=_hf_experts(data), names=names)


def _dp_before_build(args) -> int:
    """DP as --dp, or --gpus over TP x PP (no CP flag: an override's CP is checked after the build), else 1."""
    gpus, per_replica = getattr(args, "gpus", None), (args.tp or 1) * (args.pp or 1)
    if args.dp or not gpus or gpus % per_replica:
        return args.dp or 1
    return gpus // per_replica


def _hf_shape_problem(args, data: dict):
    """A shape field of config.json below 1 (the estimate's rule), unless an override sets the field."""
    from megatron_bridge_ext.estimate.configs import SHAPE_FIELDS, bad_shape, shape_fix

    for field, key in SHAPE_FIELDS.items():
        value = data.get(key)
        if bad_shape(value) and not overridden(args.overrides, f"model.{field}"):
            return _bad(f"--hf-config {args.hf_config}", f"{key} is {value!r}",
                        f"{shape_fix(key)} in the file, or override model.{field}")
    return None

