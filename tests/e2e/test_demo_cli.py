"""The docs' demo commands end to end: ``mbx demo`` and ``mbx demo --bridge`` start 2 ranks themselves and
print their results."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mbx_demo_starts_two_ranks_and_reports_both(tmp_path):
    env = dict(os.environ, MBX_LOG_LEVEL="WARNING")
    command = [sys.executable, "-m", "megatron_bridge_ext.cli", "demo", "--steps", "2",
               "--variants", "baseline", "shard_local", "--json"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    rows = {(r["variant"], r["rank"]): r for r in result["rows"]}
    assert set(rows) == {("baseline", 0), ("baseline", 1), ("shard_local", 0), ("shard_local", 1)}
    base, local = rows[("baseline", 0)], rows[("shard_local", 0)]
    assert local["saved_bytes_per_step"][-1] < base["saved_bytes_per_step"][-1]
    assert [d["strategy"] for d in local["lora_report"]].count("shard_local") == 4


def test_mbx_demo_writes_its_log_lines_above_the_progress_bar_and_filters_known_noise(tmp_path):
    """The text run at the default INFO: each of our log lines written while rank 0's bar is shown stands on its
    own, after the bar is cleared (the bar redraws with a carriage return, so the last carriage-return segment of a
    log line is the log record alone, not bar text followed by it); torch's "No CUDA runtime is found" of each
    rank is filtered."""
    env = {k: v for k, v in os.environ.items() if k != "MBX_LOG_LEVEL"}
    command = [sys.executable, "-m", "megatron_bridge_ext.cli", "demo", "--steps", "2",
               "--variants", "baseline", "shard_local"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, timeout=600)  # bytes: keeps "\r"
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr[-3000:]
    ours = [line for line in stderr.split("\n") if "INFO megatron_bridge_ext" in line]
    under_the_bar = [line for line in ours if "mbx demo:" in line]  # written while the bar was on the screen
    assert under_the_bar, stderr[-3000:]
    assert [line for line in ours if not line.split("\r")[-1].startswith("INFO megatron_bridge_ext")] == []
    assert "No CUDA runtime is found" not in stderr


def committed_bridge_rows() -> list[dict]:
    """The rows of the committed ``mbx demo --bridge --json`` run whose tables docs/tools/bridge-loop.md shows."""
    (saved,) = sorted((ROOT / "benchmarks").glob("*-cpu-mbx-demo-bridge.json"))
    return json.loads(saved.read_text())["rows"]


def test_mbx_demo_bridge_trains_through_bridges_loop_and_reports_memory_from_inside_it(tmp_path):
    from megatron_bridge_ext.demo.bridge_table import compare_runs

    # tiny_gpt: s=32, b=2, h=64, t=2, 2 layers; LoRA-A of linear_qkv and linear_fc1 keep s*b*h/t instead of s*b*h.
    s, b, h, t, layers, fp32 = 32, 2, 64, 2, 2, 4
    keep = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "megatron_bridge_ext.cli", "demo", "--bridge", "--json", "--keep", str(keep)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    done = subprocess.run(command, cwd=tmp_path, env=dict(env, MBX_LOG_LEVEL="WARNING"),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # Bridge's own log went to stderr
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["baseline", "shard_local", "shard_local+core_attn"]
    bridge, ours, recomputed = rows.values()
    assert [len(r["losses"]) for r in rows.values()] == [4, 4, 4]  # --steps defaults to 4
    assert bridge["lora_input_bytes"] - ours["lora_input_bytes"] == layers * 2 * s * b * h * fp32 * (t - 1) // t
    assert [r["core_attn_recompute"] for r in rows.values()] == [{"checkpointed_forwards": 0, "recomputed": 0}] * 2 + [
        {"checkpointed_forwards": layers * 2, "recomputed": layers * 2}]  # 2 micro-batches per step
    assert recomputed["attention_bytes"] < ours["attention_bytes"]
    assert "expandable_segments:True" in ours["environment"].get("PYTORCH_CUDA_ALLOC_CONF", "")
    assert "lm loss" in done.stderr  # Bridge's training log: these numbers come from Bridge's loop
    assert (keep / "base" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # docs/tools/bridge-loop.md shows the committed run's tables (tests/unit/repo/test_docs_figures.py). This run matches it:
    # names, bytes, counts and environment exactly; losses and grad norms, which depend on the CPU's
    # floating-point kernels, within twice bridge_table.rounding_bounds() (fp32 reductions summed in another order).
    assert compare_runs(result["rows"], committed_bridge_rows()) == []


def test_mbx_demo_bridge_refuses_a_bad_option_with_one_line_before_starting_ranks():
    command = [sys.executable, "-m", "megatron_bridge_ext.cli", "demo", "--bridge", "--steps", "0"]
    done = subprocess.run(command, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == "mbx demo --bridge: error: argument --steps: 0 must be at least 1"
    assert "starting" not in done.stderr  # no rank was started
