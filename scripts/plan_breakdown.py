"""Where ``mbx plan``'s time goes: importing Bridge, building the config, each of our estimates, Bridge's
estimate, the rest of the lever walk, and rendering.

    python scripts/plan_breakdown.py [MBX PLAN ARGUMENTS]   (default: the README's Qwen3-8B example)

Runs the plan as ``mbx plan`` does (the same checks, import hooks and build), in this one process, with a
timer around each phase; prints one line per phase in seconds (wall clock) and the machine's load average
before and after, since on a shared machine the figures move with it. A benchmark, not a test: the docs
quote its output (docs/tools/plan.md, "Where the time goes").
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

README_EXAMPLE = ["--hf-config", "tests/data/qwen3-8b/config.json", "--tp", "2", "--seq", "8192", "--peft", "lora",
                  "--dp", "4", "--gpu-memory", "40GB"]


class Timers:
    """Seconds per phase, in the order first seen; a phase timed again (each estimate) adds a numbered line."""

    def __init__(self):
        self.lines: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.lines.append((name, time.perf_counter() - start))

    def wrap(self, owner, attr: str, name):
        """Time every call of ``owner.attr``; ``name(args, kwargs)`` labels the call."""
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.phase(name(args, kwargs)):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)


def _estimate_label(count=[0]):
    def label(args, kwargs):
        count[0] += 1
        return "our estimate #1 (the config as is)" if count[0] == 1 else f"our estimate #{count[0]}"
    return label


def main(argv: list[str]) -> int:
    load_before = os.getloadavg()
    timers = Timers()
    with timers.phase("import megatron_bridge_ext.cli"):
        from megatron_bridge_ext import cli, logs
        from megatron_bridge_ext.cli import plan as plan_cli
    args = cli.build_parser().parse_args(["plan", *(argv or README_EXAMPLE)])
    problem = plan_cli.check_args(args)
    if problem:
        print(f"plan_breakdown: {problem}", file=sys.stderr)
        return 2
    logs.configure()
    from megatron_bridge_ext.patches.registry import plan_imports

    with plan_imports(), contextlib.redirect_stdout(sys.stderr):
        with timers.phase("import Megatron Bridge (and torch, Megatron Core)"):
            from megatron_bridge_ext.estimate import configs

            configs._bridge()
            import megatron.bridge  # noqa: F401
            from megatron.bridge.recipes.gpt import vanilla_gpt  # noqa: F401
            from megatron.bridge.training.utils import omegaconf_utils  # noqa: F401
            from megatron_bridge_ext import planner
            from megatron_bridge_ext.estimate import memory  # noqa: F401
        timers.wrap(configs, "build", lambda a, k: "build the config")
        timers.wrap(planner.Planner, "estimate", _estimate_label())
        timers.wrap(planner, "_bridge", lambda a, k: "Bridge's estimate_training_memory")
        with timers.phase("plan (config, estimates, Bridge's, the walk)"):
            result = plan_cli._plan(args)
    with timers.phase("render the text"):
        plan_cli.format_plan(result)
    _print(timers, load_before, os.getloadavg())
    return 0


def _print(timers: Timers, load_before, load_after) -> None:
    lines = dict(timers.lines)
    inner = sum(s for n, s in timers.lines if n.startswith(("build", "our estimate", "Bridge's")))
    walk = lines["plan (config, estimates, Bridge's, the walk)"] - inner
    estimates = [(n, s) for n, s in timers.lines if n.startswith("our estimate")]
    width = 52
    for name, seconds in timers.lines:
        if not name.startswith("plan ("):
            print(f"{name:<{width}} {seconds:7.2f} s")
    print(f"{'the walk (levers, step times, costs) beside those':<{width}} {walk:7.2f} s")
    print(f"{'our estimates together (' + str(len(estimates)) + ')':<{width}} {sum(s for _, s in estimates):7.2f} s")
    ours = sum(s for n, s in timers.lines if not n.startswith(("import Megatron", "plan (", "Bridge's"))) + walk
    print(f"{'our own work (everything but the imports and Bridge)':<{width}} {ours:7.2f} s")
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
