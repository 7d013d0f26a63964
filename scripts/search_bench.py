"""Time ``mbx plan --search`` on the three workloads it is sized for and print what the walk did: candidates
enumerated, legal, estimated, pruned, traces run and reused, seconds per phase, the answer and the front's size.

Usage: PYTHONPATH=. python scripts/search_bench.py [--case NAME]   (committed output: benchmarks/search.txt)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

CASES = {
    "llama-3-70b-32gpu-fp8": ["--gpus", "32", "--hf-config", "tests/data/llama-3-70b/config.json", "--seq", "4096",
                              "--global-batch", "32", "--gpu-memory", "80GiB",
                              "mixed_precision=bf16_with_fp8_current_scaling_mixed"],
    "qwen3-30b-a3b-16gpu": ["--gpus", "16", "--hf-config", "tests/data/qwen3-30b-a3b/config.json", "--seq", "4096",
                            "--global-batch", "64", "--gpu-memory", "80GiB"],
    "llama-3.1-405b-1024gpu": ["--gpus", "1024", "--hf-config", "tests/data/llama-3.1-405b/config.json", "--seq",
                               "8192", "--global-batch", "1024", "--gpu-memory", "80GiB"],
}


def run(name: str, argv: list[str]) -> str:
    from megatron_bridge_ext.cli import build_parser
    from megatron_bridge_ext.cli.plan import build_config, check_args, search_built
    from megatron_bridge_ext.patches.registry import plan_imports
    from megatron_bridge_ext.search import report

    args = build_parser().parse_args(["plan", "--search", *argv])
    problem = check_args(args)
    if problem:
        return f"{name}: {problem}"
    start = time.process_time()
    with plan_imports(), contextlib.redirect_stdout(sys.stderr):
        built, options = build_config(args)  # imports Bridge, the recipe and the model's bridge
        import megatron.core.models.gpt.gpt_model  # noqa: F401  (what the first estimate imports)
        import torch.distributed.tensor  # noqa: F401
        imports = time.process_time() - start
        start = time.process_time()
        result = search_built(args, built.cfg, options)
    own = time.process_time() - start
    answer = result.answer
    return "\n".join([f"== {name}: mbx plan --search {' '.join(argv)}",
                      f"CPU seconds building the config and importing Bridge (not counted): {imports:.1f}",
                      f"CPU seconds (own work, after imports): {own:.1f}",
                      report.as_text(result) if answer or result.evaluated else "no candidate estimated"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    for name in parser.parse_args().case or list(CASES):
        print(run(name, CASES[name]), flush=True)


if __name__ == "__main__":
    main()
