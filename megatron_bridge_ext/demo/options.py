"""The options ``mbx demo`` and ``mbx bench memory`` share, checked in the parent process.

Everything a rank would fail on (a variant name, a shape TP cannot split, a step count) is
refused here with one line, before torchrun starts any rank.
"""

from __future__ import annotations

import argparse

from megatron_bridge_ext.peft import kinds
from megatron_bridge_ext.testing import tiny_model, variants

SHAPE_OPTIONS = (
    ("--layers", "layers", "transformer layers"),
    ("--hidden", "hidden", "hidden size h"),
    ("--ffn", "ffn", "MLP hidden size"),
    ("--heads", "heads", "attention heads"),
    ("--kv-heads", "kv_heads", "key/value heads (query groups)"),
    ("--seq", "seq", "sequence length s"),
    ("--micro-batch", "micro_batch", "micro-batch size b"),
    ("--lora-rank", "lora_rank", "LoRA rank r"),
    ("--tp", "tp", "tensor-parallel size t (= ranks started)"),
)


EXAMPLES = {
    "mbx demo": """
mbx demo                                     # every variant, LoRA, 3 steps on 2 ranks
mbx demo --peft dora --variants baseline shard_local --seq 512
""",
    "mbx bench memory": """
mbx bench memory                             # the LoRA-A input variants side by side
mbx bench memory --peft canonical_lora --steps 10 --save bench
""",
}
"""Two worked examples per command, shown at the end of its --help."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in each option's help, once; the examples kept as written.

    A help text that states its default itself, or an option without a value to show (an on/off flag, a
    default of None), gets no second "(default: ...)".
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False) or action.nargs == 0:
            return text
        return super()._get_help_string(action)


class OptionError(ValueError):
    """A bad command-line value; the message names the option and the fix."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def save_prefix(text: str) -> str:
    """``--save PREFIX``: its folder must exist (checked before any rank starts)."""
    import os

    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist; create it or choose another PREFIX")
    return text


def parser(prog: str, description: str, defaults: tiny_model.TinyGPTShape, *, steps: int,
           variant_names: list[str], steps_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=_HelpFormatter,
                                epilog="examples:\n" + "\n".join("  " + line for line in
                                                                   EXAMPLES[prog].strip("\n").splitlines()))
    shape = p.add_argument_group("model shape")
    for flag, attr, help_text in SHAPE_OPTIONS:
        shape.add_argument(flag, dest=attr, type=_positive_int, default=getattr(defaults, attr), help=help_text)
    shape.add_argument("--dtype", default=defaults.dtype, choices=sorted(tiny_model.DTYPES), help="parameter dtype")
    shape.add_argument("--peft", default=defaults.peft, choices=kinds.KINDS,
                       help="adapter kind: Bridge's LoRA, DoRA or CanonicalLoRA and ours of the same kind "
                            "(canonical_lora runs the model with SwiGLU: its up/gate adapters are the halves of "
                            "a gated linear_fc1)")
    p.add_argument("--steps", type=_positive_int, default=steps, help=steps_help)
    p.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                   help=f"variants to run, in this order (default: {' '.join(variant_names)}); "
                        f"choose from {', '.join(variants.VARIANTS)}")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table (default: the table)")
    p.add_argument("--verbose", action="store_true",
                   help="also show the upstream warnings known to be harmless here (default: filtered; "
                        "docs/tools/demo.md lists them)")
    p.add_argument("--save", type=save_prefix, default=None, metavar="PREFIX",
                   help="also write PREFIX.txt (the table) and PREFIX.json (the figures) of this one run")
    return p


def shape_from_args(args: argparse.Namespace) -> tiny_model.TinyGPTShape:
    fields = ("layers", "hidden", "ffn", "heads", "kv_heads", "seq", "micro_batch", "lora_rank", "tp", "dtype", "peft")
    return tiny_model.TinyGPTShape(**{f: getattr(args, f) for f in fields}, swiglu=args.peft == "canonical_lora")


def check(args: argparse.Namespace) -> None:
    """Refuse what the ranks would fail on; raises :class:`OptionError` naming the option."""
    shape = shape_from_args(args)
    problems = tiny_model.shape_problems(shape)
    if problems:
        raise OptionError(problems[0])
    if args.variants:
        try:
            variants.select(args.variants, args.peft)
        except ValueError as error:
            raise OptionError(f"--variants: {error}") from None
