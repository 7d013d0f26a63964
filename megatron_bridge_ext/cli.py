"""The ``mbx`` command.

Subcommands are thin: each parses its options and calls the module that does the work.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def _patches(args: argparse.Namespace) -> int:
    from megatron_bridge_ext.patches import apply_all, status_all

    statuses = apply_all() if args.apply else status_all()
    if args.json:
        print(json.dumps([asdict(s) for s in statuses], indent=2))
        return 0
    cols = ("name", "target", "versions", "status", "reason")
    rows = [[getattr(s, c) for c in cols] for s in statuses]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols[:-1])]
    for cells in [list(cols), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(cells[:-1], widths)) + "  " + cells[-1])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mbx", description="megatron-bridge-ext: cut peak GPU memory in Megatron Bridge training")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("patches", help="list every upstream patch with target, version range, status and reason")
    p.add_argument("--no-apply", dest="apply", action="store_false",
                   help="report without applying (status of patches that need imports may read 'not applied')")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_patches)

    sub.add_parser("demo", help="train the tiny LoRA model on 2 ranks and show activation memory per variant",
                   add_help=False)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench.add_parser("memory", help="LoRA-A input variants side by side (mbx bench memory --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from megatron_bridge_ext import demo

        return demo.main(argv[1:])
    if argv[:2] == ["bench", "memory"]:
        from megatron_bridge_ext import bench

        return bench.main(argv[2:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
