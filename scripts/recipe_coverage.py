"""Every language-model recipe of the installed Megatron Bridge through the estimate, as ``mbx plan`` builds it.

    python scripts/recipe_coverage.py [--family NAME ...] [--recipe MODULE:FUNCTION ...] [--json FILE]

Each recipe (``megatron_bridge_ext.estimate.recipes``) is built as ``mbx plan --recipe SPEC --hf-config FILE
--gpu-memory 80GiB`` builds it (the same checks, import hooks and config building), with the config.json of the
model it reads (``tests/data/<model>/config.json``, :data:`MODELS`) and at its own GPU count: the count its name
states, or, where it states none, the smallest world its layout fits (said in the row). Then the estimate runs.

One row per recipe: estimated (each phase's peak in GiB, the largest marked), refused (the finding: a feature the
estimate names as not modelled, or the input it refuses), or crashed (an error no check foresaw); and the seconds it
took. Then the counts per family, and the total. A benchmark, not a test: its output is committed under
benchmarks/, and docs/support-matrix.md says family by family what it shows.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
GPU_MEMORY = "80GiB"
"""The device the rows are built for: the estimate does not depend on it (the plan's verdict does)."""

MODELS = {
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b", "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    "meta-llama/Meta-Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Meta-Llama-3.1-70B": "llama-3.1-70b",
    "meta-llama/Meta-Llama-3.1-405B": "llama-3.1-405b", "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b", "meta-llama/Llama-2-7b-hf": "llama-2-7b",
    "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
    "google/gemma-2-2b": "gemma-2-2b", "google/gemma-2-9b": "gemma-2-9b", "google/gemma-2-27b": "gemma-2-27b",
    "google/gemma-3-1b-pt": "gemma-3-1b-pt", "google/gemma-4-E4B-it": "gemma-4-e4b-it",
    "Qwen/Qwen2-0.5B": "qwen2-0.5b", "Qwen/Qwen2-1.5B": "qwen2-1.5b", "Qwen/Qwen2-7B": "qwen2-7b",
    "Qwen/Qwen2-72B": "qwen2-72b", "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b", "Qwen/Qwen2.5-1.5B": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b", "Qwen/Qwen2.5-14B": "qwen2.5-14b", "Qwen/Qwen2.5-32B": "qwen2.5-32b",
    "Qwen/Qwen2.5-72B": "qwen2.5-72b", "Qwen/Qwen3-0.6B": "qwen3-0.6b", "Qwen/Qwen3-1.7B": "qwen3-1.7b",
    "Qwen/Qwen3-4B": "qwen3-4b", "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen3-14B": "qwen3-14b",
    "Qwen/Qwen3-32B": "qwen3-32b", "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b-instruct", "Qwen/Qwen3.5-9B-Base": "qwen3.5-9b-base",
    "Qwen/Qwen3.5-35B-A3B-Base": "qwen3.5-35b-a3b-base",
    "deepseek-ai/DeepSeek-V2": "deepseek-v2", "deepseek-ai/DeepSeek-V2-Lite": "deepseek-v2-lite",
    "deepseek-ai/DeepSeek-V3": "deepseek-v3", "deepseek-ai/DeepSeek-V4-Flash": "deepseek-v4-flash",
    "deepseek-ai/DeepSeek-V4-Pro": "deepseek-v4-pro", "moonshotai/Moonlight-16B-A3B": "moonlight-16b-a3b",
    "moonshotai/Kimi-K2-Instruct": "kimi-k2-instruct", "zai-org/GLM-4.5": "glm-4.5", "zai-org/GLM-4.5-Air": "glm-4.5-air",
    "zai-org/GLM-5.2": "glm-5.2", "MiniMaxAI/MiniMax-M3": "minimax-m3", "stepfun-ai/Step-3.5-Flash": "step-3.5-flash",
    "LGAI-EXAONE/K-EXAONE-236B-A23B": "k-exaone-236b-a23b", "LGAI-EXAONE/EXAONE-4.0-1.2B": "exaone-4.0-1.2b",
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "nemotron-3-nano-30b-a3b",
    "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16": "nemotron-3-super-120b-a12b",
    "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16": "nemotron-3-ultra-550b-a55b",
    "nvidia/Nemotron-H-4B-Base-8K": "nemotron-h-4b-base-8k", "nvidia/Nemotron-H-8B-Base-8K": "nemotron-h-8b-base-8k",
    "nvidia/Nemotron-H-47B-Base-8K": "nemotron-h-47b-base-8k", "nvidia/Nemotron-H-56B-Base-8K": "nemotron-h-56b-base-8k",
    "nvidia/NVIDIA-Nemotron-Nano-9B-v2-Base": "nvidia-nemotron-nano-9b-v2-base",
    "nvidia/NVIDIA-Nemotron-Nano-12B-v2-Base": "nvidia-nemotron-nano-12b-v2-base",
}
"""The Hugging Face model each recipe reads -> its folder under tests/data (config.json and SOURCE.md)."""
HF_TOKENIZER_MODELS = ("tokenizer_model",)
"""Where a recipe that reads no model config names the Hugging Face model of its tokenizer (its vocabulary)."""

ESTIMATED, REFUSED, CRASHED = "estimated", "refused", "crashed"


@dataclass
class Row:
    family: str
    spec: str
    status: str
    seconds: float
    gpus: Optional[int] = None
    gpus_source: str = ""
    hf_model: Optional[str] = None
    phases: dict = field(default_factory=dict)
    """Each phase's peak in bytes (the largest is ``largest``)."""
    largest: Optional[str] = None
    layout: str = ""
    finding: str = ""


def hf_model_read(spec: str) -> tuple[Optional[str], object]:
    """The Hugging Face model a recipe reads (its config, else its tokenizer's model), from one call with the hub
    closed (the read fails at once), and the config the call returned when it read none."""
    from megatron_bridge_ext.estimate import configs
    from megatron_bridge_ext.patches import bridge_recipe_hf_config

    module, _, function = spec.partition(":")
    import importlib

    recipe = getattr(importlib.import_module(module), function)
    os.environ["HF_HUB_OFFLINE"] = "1"
    with bridge_recipe_hf_config.answering(None) as hub, _quiet():
        try:
            cfg = recipe()
        except Exception:  # noqa: BLE001  (the closed hub fails the read: only the id is wanted here)
            cfg = None
    if hub.requested:
        if cfg is None:  # the read failed: the same call with the model's config.json answering it
            cfg = _answered(recipe, hub.requested)
        return hub.requested, cfg
    tokenizer = getattr(getattr(cfg, "tokenizer", None), "tokenizer_model", None)
    if cfg is not None and getattr(cfg.model, "vocab_size", 1) is None and \
            getattr(cfg.tokenizer, "tokenizer_type", None) == configs.HF_TOKENIZER and tokenizer:
        return str(tokenizer), cfg
    return None, cfg


def _answered(recipe, model_id: str):
    """The recipe's config with its hub read answered by the model's config.json under tests/data (None when that
    file is missing or the recipe fails anyway: the row then says why)."""
    from megatron_bridge_ext.estimate import configs
    from megatron_bridge_ext.patches import bridge_recipe_hf_config

    folder = MODELS.get(model_id)
    path = folder and os.path.join(DATA, folder, "config.json")
    if not path or not os.path.exists(path):
        return None
    with bridge_recipe_hf_config.answering(configs.hf_config_object(configs.read_hf_config(path))), _quiet():
        try:
            return recipe()
        except Exception:  # noqa: BLE001  (the row's own build reports the failure)
            return None


def smallest_world(cfg) -> int:
    """The fewest GPUs the recipe's layout runs on: TP x PP x CP x DP with the smallest DP that Core's expert layout
    takes (EP x ETP dividing DP x TP x CP)."""
    from megatron_bridge_ext.levers.parallelism.constraints import expert_sizes

    model = cfg.model
    per_replica = model.tensor_model_parallel_size * model.pipeline_model_parallel_size * (model.context_parallel_size
                                                                                            or 1)
    ep, etp = expert_sizes(model)
    dp = 1
    while (dp * model.tensor_model_parallel_size * (model.context_parallel_size or 1)) % (ep * etp):
        dp += 1
    return per_replica * dp


def run_one(family: str, spec: str) -> Row:
    from megatron_bridge_ext.cli import build_parser
    from megatron_bridge_ext.cli import plan as plan_cli
    from megatron_bridge_ext.estimate import configs, estimate
    from megatron_bridge_ext.findings import Refused
    from megatron_bridge_ext.patches.registry import plan_imports
    from megatron_bridge_ext.plan_config import build_config

    start = time.perf_counter()
    row = Row(family, spec, CRASHED, 0.0)
    try:
        model_id, probe = hf_model_read(spec)
        row.hf_model = model_id
        argv = ["plan", "--recipe", spec, "--gpu-memory", GPU_MEMORY]
        if model_id is not None:
            folder = MODELS.get(model_id)
            if folder is None or not os.path.exists(os.path.join(DATA, folder, "config.json")):
                raise Refused("coverage", [_finding(f"no config.json of {model_id} under tests/data")])
            argv += ["--hf-config", os.path.join(DATA, folder, "config.json")]
        stated = configs.stated_gpus(spec.partition(":")[2])
        if stated is None and probe is not None:
            row.gpus, row.gpus_source = smallest_world(probe), "the smallest world of its layout (its name states none)"
            argv += ["--gpus", str(row.gpus)]
        elif stated is not None:
            row.gpus, row.gpus_source = stated, "its name"
        args = build_parser().parse_args(argv)
        problem = plan_cli.check_args(args)
        if problem:
            raise Refused("coverage", [_finding(problem)])
        with plan_imports(), _quiet():
            built, options = build_config(args)
            est = estimate(built.cfg, **options)
        row.status = ESTIMATED
        row.phases = {p.name: p.peak_bytes for p in est.phases}
        row.largest = est.peak_phase.name
        s = est.settings
        row.layout = (f"TP{s.tp} PP{s.pp}{f' VPP{s.vpp}' if s.vpp else ''} CP{s.cp} DP{s.dp}"
                      + (f" EP{s.moe.ep} ETP{s.moe.etp}" if s.moe else "") + f" seq {s.seq_length} mbs {s.micro_batch}")
    except Refused as refused:
        row.status, row.finding = REFUSED, refused.one_line()
    except Exception as error:  # noqa: BLE001  (what a crash is: any other error, reported by type and line)
        text = str(error).strip().splitlines()
        row.finding = f"{type(error).__name__}: {text[0] if text else ''}"[:300]
    row.seconds = time.perf_counter() - start
    return row


def _finding(text: str):
    from megatron_bridge_ext.findings import ERROR, Finding

    return Finding("coverage", ERROR, "coverage", text, "see the row")


@contextlib.contextmanager
def _quiet():
    """Upstream's prints and warnings while a recipe and its model are built (the row is the output)."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def format_rows(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        head = f"{r.status:9} {r.seconds:6.1f}s  {r.spec}"
        if r.gpus:
            head += f"  [{r.gpus} GPUs, {r.gpus_source}]"
        lines.append(head)
        if r.status == ESTIMATED:
            phases = ", ".join(f"{name}{' (largest)' if name == r.largest else ''} {_gib(b)} GiB"
                               for name, b in r.phases.items())
            lines.append(f"          {r.layout}: {phases}")
        else:
            lines.append(f"          {r.finding}")
    return "\n".join(lines)


def format_counts(rows: list[Row]) -> str:
    families = sorted({r.family for r in rows})
    lines = [f"{'family':12} {'recipes':>7} {'estimated':>9} {'refused':>7} {'crashed':>7}"]
    for family in families + ["all"]:
        mine = [r for r in rows if family in ("all", r.family)]
        counts = [sum(r.status == s for r in mine) for s in (ESTIMATED, REFUSED, CRASHED)]
        lines.append(f"{family:12} {len(mine):7} {counts[0]:9} {counts[1]:7} {counts[2]:7}")
    total = len(rows)
    done = sum(r.status == ESTIMATED for r in rows)
    lines.append(f"estimated {done} of {total} recipes ({100 * done / max(total, 1):.1f}%), "
                 f"crashed {sum(r.status == CRASHED for r in rows)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", help="only this family (repeatable)")
    parser.add_argument("--recipe", action="append", help="only this MODULE:FUNCTION (repeatable)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--matrix", metavar="MARKDOWN",
                        help="rewrite the recipe section of this page (docs/support-matrix.md) from the rows")
    parser.add_argument("--from-json", metavar="FILE", help="take the rows from a --json file instead of running")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as handle:
            rows = [Row(**row) for row in json.load(handle)]
        if args.matrix:
            write_matrix(args.matrix, rows)
        print(format_counts(rows))
        return 0
    from megatron_bridge_ext import logs
    from megatron_bridge_ext.estimate.recipes import language_recipes

    logs.configure(verbose=False)
    logging.disable(logging.WARNING)
    with _quiet():
        recipes = language_recipes()
    if args.family:
        recipes = [r for r in recipes if r.family in args.family]
    if args.recipe:
        recipes = [r for r in recipes if r.spec in args.recipe]
    print(f"recipe coverage: {len(recipes)} language-model recipes of Megatron Bridge "
          f"{_version('megatron-bridge')} (Megatron Core {_version('megatron-core')}), as `mbx plan --recipe` builds "
          "them", flush=True)
    rows = []
    for recipe in recipes:
        rows.append(run_one(recipe.family, recipe.spec))
        print(format_rows(rows[-1:]), flush=True)
    print(format_counts(rows), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(r) for r in rows], handle, indent=1)
    if args.matrix:
        write_matrix(args.matrix, rows)
    return 0


MATRIX_BEGIN = "<!-- recipe-coverage: begin (scripts/recipe_coverage.py --matrix writes this section) -->"
MATRIX_END = "<!-- recipe-coverage: end -->"


def reason(finding: str) -> str:
    """A refusal's first finding without its fix: ``setting: message``."""
    return finding.split("; also: ")[0].split(" Fix: ")[0].rstrip(".")


def render_matrix(rows: list[Row]) -> str:
    """The support matrix's recipe section: per family the counts, then every recipe not estimated with the first
    finding that stops it (its setting and why), grouped by that finding."""
    families = sorted({r.family for r in rows})
    total = {status: sum(r.status == status for r in rows) for status in (ESTIMATED, REFUSED, CRASHED)}
    lines = [f"{total[ESTIMATED]} of {len(rows)} language-model recipes estimated "
             f"({100 * total[ESTIMATED] / len(rows):.1f}%), {total[REFUSED]} refused, {total[CRASHED]} crashed, each at its "
             "own GPU count with its model's config.json (`python scripts/recipe_coverage.py`).", "",
             "| family | recipes | estimated | refused | crashed |", "|---|---|---|---|---|"]
    for family in families:
        mine = [r for r in rows if r.family == family]
        lines.append(f"| {family} | {len(mine)} | {sum(r.status == ESTIMATED for r in mine)} | "
                     f"{sum(r.status == REFUSED for r in mine)} | {sum(r.status == CRASHED for r in mine)} |")
    stopped: dict[str, list[str]] = {}
    for r in rows:
        if r.status != ESTIMATED:
            stopped.setdefault(f"{r.status}: {reason(r.finding)}", []).append(r.spec.partition("recipes.")[2] or r.spec)
    lines += ["", "Recipes not estimated, by what stops them (the first finding; the recipe's spec after "
              "`megatron.bridge.recipes.`):", ""]
    for why, specs in sorted(stopped.items(), key=lambda item: (-len(item[1]), item[0])):
        lines.append(f"- {why.replace('|', '/')} ({len(specs)}): " + ", ".join(f"`{spec}`" for spec in specs))
    return "\n".join(lines)


def write_matrix(path: str, rows: list[Row]) -> None:
    with open(path) as handle:
        text = handle.read()
    head, begin, rest = text.partition(MATRIX_BEGIN)
    _, end, tail = rest.partition(MATRIX_END)
    if not begin or not end:
        raise SystemExit(f"{path}: no section between {MATRIX_BEGIN!r} and {MATRIX_END!r}")
    with open(path, "w") as handle:
        handle.write(f"{head}{MATRIX_BEGIN}\n{render_matrix(rows)}\n{MATRIX_END}{tail}")


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
