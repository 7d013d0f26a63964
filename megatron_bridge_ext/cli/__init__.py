"""The ``mbx`` command: parsing and printing only.

Each subcommand parses its options and calls the module that does the work (``mbx env`` is in
:mod:`.env`; ``mbx demo`` and ``mbx bench memory`` parse their own options in
:mod:`megatron_bridge_ext.demo`).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap

from megatron_bridge_ext.cli import diagnose, env, patches, plan

from megatron_bridge_ext.levers.allocator.guards import CUDA_GRAPH_IMPLS


PATCHES_EXAMPLES = """
mbx patches                      # which patches this environment needs
mbx patches --apply --verbose    # apply them to this process; each target and reason
"""
ENV_EXAMPLES = """
mbx env                          # the allocator settings torch reads now, and what setup would change
mbx env --nccl-ub --json         # the guard findings for a job with NCCL user buffers, as JSON
"""
RUN_EXAMPLES = """
mbx run -- torchrun --nproc_per_node=8 pretrain.py
mbx run --nccl-ub -- torchrun --nproc_per_node=8 finetune.py --config lora.yaml
"""


def _guard_options(p: argparse.ArgumentParser) -> None:
    """The settings the allocator guards depend on (as in the training config)."""
    p.add_argument("--nccl-ub", action="store_true",
                   help="ddp.nccl_ub is on (NCCL user-buffer registration; default: off)")
    p.add_argument("--cuda-graph-impl", default=None, choices=CUDA_GRAPH_IMPLS,
                   help="model.cuda_graph_impl of the training config (default: none)")
    p.add_argument("--ipc", action="store_true", default=None,
                   help="this job shares CUDA memory between processes through IPC (default: "
                        "MBX_ALLOCATOR_IPC, else off)")


def _parser(sub, name: str, examples: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with worked examples (kept as written)."""
    return sub.add_parser(name, epilog="examples:\n" + textwrap.indent(examples.strip("\n"), "  "),
                          formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mbx run", usage="mbx run [--nccl-ub] [--cuda-graph-impl X] [--ipc] -- COMMAND ...",
                                description="Turn on expandable segments in the environment, give every Python "
                                            "process of COMMAND what megatron_bridge_ext.init() installs\n(a "
                                            "sitecustomize put first on PYTHONPATH, MBX_RUN_INIT=1), then run "
                                            "COMMAND\n(e.g. torchrun ...); the exit status is the command's. Each "
                                            "option is off unless given.",
                                epilog="examples:\n" + textwrap.indent(RUN_EXAMPLES.strip("\n"), "  "),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _guard_options(p)
    return p


def _run_main(argv: list[str]) -> int:
    """``mbx run``: options up to ``--`` (or the first word that is not an option), then the command."""
    split = argv.index("--") if "--" in argv else next((i for i, a in enumerate(argv) if not a.startswith("-")),
                                                        len(argv))
    args = _run_parser().parse_args(argv[:split])  # an unknown option: mbx run's usage, exit 2
    args.cmd = argv[split + 1:] if argv[split:split + 1] == ["--"] else argv[split:]
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    import logging
    import os

    from megatron_bridge_ext import logs, run_site
    from megatron_bridge_ext.levers.allocator import setup_allocator
    from megatron_bridge_ext.findings import Refused

    command = list(args.cmd)
    if not command:
        print("mbx run: no command; usage: mbx run [--nccl-ub] [--cuda-graph-impl X] [--ipc] -- torchrun ...",
              file=sys.stderr)
        return 2
    logs.configure()
    env = dict(os.environ)
    try:
        setup_allocator(env, nccl_ub=args.nccl_ub, cuda_graph_impl=args.cuda_graph_impl, ipc=args.ipc)
    except (Refused, ValueError) as error:
        print(f"mbx run: {error}", file=sys.stderr)
        return 2
    logging.getLogger("megatron_bridge_ext.cli").info("mbx run: %s", run_site.prepare_environment(env))
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # replace this process: signals, stdin/stdout and the exit status belong to the command
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"mbx run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"mbx run: not executable: {command[0]}", file=sys.stderr)
        return 126


def build_parser() -> argparse.ArgumentParser:
    from megatron_bridge_ext import __version__

    parser = argparse.ArgumentParser(prog="mbx", description="megatron-bridge-ext: cut peak GPU memory in Megatron Bridge training")
    parser.add_argument("--version", action="version", version=f"megatron-bridge-ext {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _parser(sub, "patches", PATCHES_EXAMPLES,
                help="list every upstream patch: version range, whether this environment needs it")
    p.add_argument("--apply", action="store_true", help="apply every needed patch to this process, then report "
                                                       "(default: report only)")
    p.add_argument("--verbose", action="store_true", help="also each patch's target, reason and when it is applied")
    p.add_argument("--json", action="store_true", help="print the report as JSON (default: a table)")
    p.set_defaults(func=patches.command)

    p = _parser(sub, "env", ENV_EXAMPLES,
                help="effective allocator settings, guard findings, and torch/Megatron/TE versions")
    _guard_options(p)
    p.add_argument("--verify", action="store_true",
                   help="also apply the setup to this process and check it on the device (imports torch; "
                        "default: report only)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (default: text)")
    p.set_defaults(func=env.command)

    diagnose.add_parser(sub, _parser)
    plan.add_parser(sub, _parser)

    sub.add_parser("run", help="turn on expandable segments and megatron_bridge_ext.init()'s import hooks for the "
                               "command's Python processes, then run it (mbx run -- torchrun ...); the exit status "
                               "is the command's", add_help=False)

    sub.add_parser("demo", help="train the tiny LoRA model on 2 ranks and show activation memory per variant",
                   add_help=False)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench.add_parser("memory", help="LoRA-A input variants side by side (mbx bench memory --help)", add_help=False)
    return parser


PIPE_CLOSED_STATUS = 141
"""Exit status when the reader of stdout went away (``mbx ... | head``): 128 + SIGPIPE, what a shell reports
for a tool the closed pipe stopped."""


def main(argv: list[str] | None = None) -> int:
    """``mbx``: user errors end in one line on stderr and exit status 2, never a traceback; a reader that
    closes the pipe early (``| head``) ends every command quietly."""
    try:
        try:
            return _main(argv)
        finally:  # here, not at exit (argparse's --help exits too), so that a closed pipe is caught below
            sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()
        return PIPE_CLOSED_STATUS


def _drop_stdout() -> None:
    """Point stdout at /dev/null: Python flushes it again at exit, which would report the closed pipe."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _signed_values_attached(argv: list[str]) -> list[str]:
    """``--total-memory -5GiB`` as ``--total-memory=-5GiB``: argparse takes a word that starts with ``-`` and is
    not a plain number for an option and answers "expected one argument"; attached, the value reaches the option's
    own check, whose line names it."""
    out: list[str] = []
    for word in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def _main(argv: list[str] | None) -> int:
    from megatron_bridge_ext.logs import LogLevelError, level_from_env

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        level_from_env()
    except LogLevelError as error:
        print(f"mbx: {error}", file=sys.stderr)
        return 2
    if argv[:1] == ["run"]:
        return _run_main(argv[1:])
    if argv[:1] == ["demo"]:
        from megatron_bridge_ext.demo import train

        return train.main(argv[1:])
    if argv == ["bench"]:
        print("mbx bench: no benchmark named. Fix: mbx bench memory (the LoRA-A input variants side by side; "
              "mbx bench memory --help)", file=sys.stderr)
        return 2
    if argv[:2] == ["bench", "memory"]:
        from megatron_bridge_ext.demo import bench

        return bench.main(argv[2:])
    parser = build_parser()
    args, extra = parser.parse_known_args(_signed_values_attached(argv))
    if extra:
        if not hasattr(args, "overrides") or any(word.startswith("-") or "=" not in word for word in extra):
            parser.parse_args(argv)  # argparse's own one-line error for what is neither an option nor an override
        args.overrides = [*args.overrides, *extra]  # overrides written between or after options, as users write them
    return args.func(args)


