"""The device check: every GPU figure of the project from one command, verdicts derived from shapes.

    python -m megatron_bridge_ext.device_check.check [--out DIR] [--layers 4] [--dry-run]
    (``python -m megatron_bridge_ext.device_check``, which ``scripts/device_check.sh`` runs, installs the
    carried wheels first and calls this)

Parts, each in its own process under its own timeout, in this order (fast first):

1. preflight: GPU, torch, Megatron Core/Bridge versions, commit;
2. fragmentation: :mod:`.fragmentation_workload` with the default allocator (must run out of
   memory, and ``mbx diagnose`` on its memory stats must say fragmentation; it records memory history and
   keeps the real snapshot and OOM message in ``$OUT``, and the snapshot read back must show fragmentation
   from its blocks: the 2 * PIECE request larger than the largest free block, PIECE) and with
   ``megatron_bridge_ext.init()`` (must complete under the same cap, expandable segments verified);
3. peak memory: :mod:`.peak_memory` per variant (baseline, upstream_regather, regather,
   shard_local) on the Qwen3-8B-shaped stack, rank 0 of TP=2 through a fake process group;
   verdicts: the after-forward drop against the baseline equals 2L eligible adapters x
   s*b*h*2*(1-1/t) bytes (regather's persistent gather buffer counted apart), and the peak drop lies
   between (2L-1) and 2L adapters' worth; step-time ratios are compute only (collectives are free on
   a fake group), reported with the collective bytes per step; the memory estimate of each variant
   (``megatron_bridge_ext.estimate``) against its measured peak, within the estimate's target;
4. one GPU, the grid's tiny shapes (:mod:`.one_gpu`): the saved-activation meter against
   ``memory_allocated`` after forward at TP=1, and shard_local's after-forward saving at rank 0 of TP=2
   through a fake process group, each bound by the caching allocator's 512-byte blocks;
5. with two or more GPUs: the functional tests under NCCL (needs pytest).

``$OUT/device_check.json`` is rewritten after every part, so a kill leaves what finished. One verdict
line per check; the exit status is non-zero when a check failed or did not run. ``--dry-run`` runs
every part the CPU can run on a tiny shape (the path, not the figures) and says which parts need CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

from megatron_bridge_ext.device_check import fragmentation_workload as workload
from megatron_bridge_ext.device_check import one_gpu
from megatron_bridge_ext.device_check.peak_memory import MEASURED_VARIANTS as VARIANTS  # the estimates carried

DEFAULT_LAYERS = 4
ESTIMATES = str(Path(__file__).with_name("estimates.json"))
"""The estimates of the measured configs (package data), written where Bridge is fully installed
(``peak_memory --write-estimates``; a unit test recomputes them): tracing needs Bridge's training
config, whose imports (Hugging Face datasets, pyarrow) the carried wheel set leaves out."""
PARTS = "megatron_bridge_ext.device_check."
"""Each part runs as a module of this package in its own process, from the working directory (the
repository root on the GPU machine: git and ``tests/functional`` are read from there)."""
MiB = 1 << 20
TOLERANCE = 1 * MiB
"""Allocator slack allowed on the byte verdicts: the measured tensors are whole multiples of 512 bytes,
but cuBLAS/cuDNN workspaces may differ by a block between variants."""

PASS, FAIL, NOT_RUN, DRY, NA = "pass", "FAIL", "not run", "dry run", "n/a"
NOT_RUN_REASONS = ("no sequence_parallel_input_regather", "not started")
"""Errors that mean a variant could not run here (an older Bridge, the budget spent), not that it failed."""


class Check:
    """The JSON report, written after every part."""

    def __init__(self, out: Path, dry_run: bool):
        self.out = out
        self.path = out / "device_check.json"
        self.report = {"date": datetime.date.today().isoformat(), "dry_run": dry_run, "parts": {}, "verdicts": []}
        out.mkdir(parents=True, exist_ok=True)

    def part(self, name: str, data) -> None:
        self.report["parts"][name] = data
        self._write()

    def verdict(self, name: str, status: str, detail: str) -> None:
        self.report["verdicts"].append({"check": name, "status": status, "detail": detail})
        print(f"[{status}] {name}: {detail}", flush=True)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=str))
        tmp.replace(self.path)

    def failed(self) -> list[dict]:
        return [v for v in self.report["verdicts"] if v["status"] in (FAIL, NOT_RUN)]


BUDGET_S = 420
"""The whole check's wall-clock budget (a device command may run 10 minutes; this leaves room for the
machine's start and the wheel install). Every part's timeout is cut to what is left of it."""
_deadline: float | None = None
"""When the check's budget ends: set by :func:`main` as it starts; None (a part called on its own) runs each part
under its own timeout only."""


def _run(command: list[str], timeout: int, env: dict | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); 124 when the part's timeout, or the end of the budget, killed it."""
    if _deadline is not None:
        left = int(_deadline - time.monotonic())
        if left < 5:
            return 124, "", "not started: the check's budget (--budget) is spent"
        timeout = min(timeout, left)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env if env is not None else dict(os.environ))
        return done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return 124, out, f"timed out after {timeout} s"


def _last_json(text: str):
    for line in reversed((text or "").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def preflight() -> dict:
    import torch

    from megatron_bridge_ext.versions import package_versions

    commit = os.environ.get("MBX_COMMIT")
    if not commit:
        code, out, _ = _run(["git", "rev-parse", "HEAD"], 10)
        commit = out.strip() if code == 0 else "unknown (no git checkout; set MBX_COMMIT)"
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_bytes": props.total_memory, "count": torch.cuda.device_count()}
    return {"gpu": gpu, "versions": package_versions(), "torch_runtime": torch.__version__,
            "python": sys.version.split()[0], "commit": commit}


def fragmentation(check: Check, cuda: bool) -> None:
    if not cuda:
        _fragmentation_dry(check)
        return
    runs = {}
    clean = {"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": ""}
    for mode in ("default", "expandable"):
        env = {k: v for k, v in os.environ.items() if k not in clean}
        started = time.time()
        keep = ["--keep", str(check.out)] if mode == "default" else []
        code, out, err = _run([sys.executable, "-m", PARTS + "fragmentation_workload", "--mode", mode, "--json",
                               *keep], 120, env)
        runs[mode] = {"exit": code, "seconds": round(time.time() - started, 1), "result": _last_json(out),
                      "stderr_tail": err[-1500:]}
        check.part("fragmentation", runs)
    default, expandable = runs["default"]["result"] or {}, runs["expandable"]["result"] or {}
    stats = default.get("full_stats")
    diagnosed = None
    if stats:
        path = check.out / "fragmentation_oom_stats.json"
        path.write_text(json.dumps(stats))
        code, out, err = _run([sys.executable, "-m", "megatron_bridge_ext.cli", "diagnose", str(path),
                               "--total-memory", f"{default.get('total_memory')}B"], 60)
        diagnosed = out.splitlines()[0] if code == 0 and out else f"mbx diagnose failed: {err[-300:]}"
        runs["default"]["mbx_diagnose"] = diagnosed
        check.part("fragmentation", runs)
    ok = bool(default.get("oom")) and (diagnosed or "").startswith("fragmentation:")
    check.verdict("fragmentation: default allocator", PASS if ok else FAIL,
                  f"OOM {default.get('oom')}; mbx diagnose: {diagnosed}")
    check.verdict("fragmentation: the real snapshot", *judge_snapshot(check.out / workload.SNAPSHOT, PASS))
    check.verdict("fragmentation: mbx diagnose on the real OOM message and snapshot",
                  *judge_cli([check.out / workload.MESSAGE, check.out / workload.SNAPSHOT], PASS))
    ok = bool(expandable.get("completed") and expandable.get("reserved_within_cap")
              and (expandable.get("verify") or {}).get("in_effect"))
    check.verdict("fragmentation: megatron_bridge_ext.init()", PASS if ok else FAIL,
                  f"completed {expandable.get('completed')}, reserved within the cap "
                  f"{expandable.get('reserved_within_cap')}, verify: {(expandable.get('verify') or {}).get('message')}")


def judge_snapshot(path: Path, passed: str) -> tuple[str, str]:
    """``passed`` when the snapshot at ``path``, read back as ``mbx diagnose`` reads it, shows fragmentation from
    its blocks with the workload's geometry: a 2 * PIECE request, PIECE the largest free block."""
    from megatron_bridge_ext.diagnose.snapshot import read_snapshot

    if not path.is_file():
        return FAIL, f"no snapshot at {path}"
    try:
        with open(path, "rb") as handle:
            devices = read_snapshot(handle, str(path)).devices
    except ValueError as error:
        return FAIL, str(error)
    device = next((d for d in devices if d.oom), None)
    if device is None:
        return FAIL, f"{path}: no device has an oom entry"
    verdict = device.verdict
    ok = (verdict.kind, verdict.fragmentation) == ("fragmentation", "shown") and \
        (device.oom.request_bytes, device.largest_free_block_bytes) == (2 * workload.PIECE, workload.PIECE)
    return (passed if ok else FAIL), f"{verdict.kind} {verdict.fragmentation}: {verdict.reason}"


def judge_cli(paths: list[Path], passed: str) -> tuple[str, str]:
    """``passed`` when ``mbx diagnose`` itself, given each file as a user would, calls it fragmentation: the OOM
    message as a one-line log ("rank ?: fragmentation: ..."), the snapshot ("snapshot ...: fragmentation shown")."""
    details, ok = [], True
    for path in paths:
        if not path.is_file():
            return FAIL, f"no file at {path}"
        code, out, err = _run([sys.executable, "-m", "megatron_bridge_ext.cli", "diagnose", str(path)], 60)
        lines = out.splitlines()
        said = next((line for line in lines if "fragmentation" in line), lines[0] if lines else "")
        ok = ok and code == 0 and ("rank ?: fragmentation: " in out or "fragmentation shown" in out)
        details.append(f"{path.name}: {said[:200] if code == 0 else err.strip()[-200:]}")
    return (passed if ok else FAIL), "; ".join(details)


def _fragmentation_dry(check: Check) -> None:
    """On a CPU, the path only: the workload's expandable mode runs ``megatron_bridge_ext.init()`` from the
    carried packages, ``mbx diagnose`` reads the stats the workload's geometry implies at its OOM, and the
    snapshot reader reads the snapshot it implies."""
    code, out, err = _run([sys.executable, "-m", PARTS + "fragmentation_workload", "--mode", "expandable", "--json"],
                          120)
    result = _last_json(out) or {}
    setup = result.get("setup")  # the script exits 1 without CUDA ("skipped"), after init() ran
    path = check.out / "fragmentation_geometry_stats.json"
    path.write_text(json.dumps(workload.stats_at_the_oom()))
    total = workload.BIG + workload.HEADROOM
    dcode, dout, derr = _run([sys.executable, "-m", "megatron_bridge_ext.cli", "diagnose", str(path),
                              "--total-memory", f"{total}B", "--expandable-segments", "off"], 60)
    diagnosed = dout.splitlines()[0] if dcode == 0 and dout else f"mbx diagnose failed: {derr[-300:]}"
    check.part("fragmentation", {"dry_run": {"init_exit": code, "init_setup": setup, "stderr_tail": err[-1500:],
                                             "mbx_diagnose": diagnosed}})
    ok = bool(result.get("skipped") and setup) and diagnosed.startswith("fragmentation:")
    check.verdict("fragmentation", DRY if ok else FAIL,
                  f"needs CUDA for the allocator run; path: init() {'ran' if setup else 'failed'}, mbx diagnose on the workload's "
                  f"geometry: {diagnosed}")
    snapshot = check.out / "fragmentation_geometry_snapshot.pickle"
    with open(snapshot, "wb") as handle:
        pickle.dump(workload.snapshot_at_the_oom(), handle)
    status, detail = judge_snapshot(snapshot, DRY)
    check.verdict("fragmentation: the snapshot", status, f"needs CUDA for the real snapshot; the workload's geometry "
                                                         f"read back: {detail}")
    status, detail = judge_cli([snapshot], DRY)
    check.verdict("fragmentation: mbx diagnose on the real OOM message and snapshot", status,
                  f"needs CUDA for the real message; mbx diagnose on the geometry's snapshot: {detail}")


def _adapter_bytes(shape: dict) -> int:
    """:func:`megatron_bridge_ext.testing.peak.adapter_bytes` of a reported shape (dtype by name)."""
    import torch

    from megatron_bridge_ext.testing.peak import adapter_bytes

    return adapter_bytes(shape["seq"], shape["micro_batch"], shape["hidden"], getattr(torch, shape["dtype"]),
                         shape["tp"])


def peak_memory(check: Check, layers: int, dry_run: bool, cuda: bool) -> None:
    rows = {}
    for variant in VARIANTS:
        command = [sys.executable, "-m", PARTS + "peak_memory", "--variant", variant, "--layers", str(layers), "--json",
                   "--estimates", ESTIMATES]
        if dry_run or not cuda:
            command.append("--dry-run")
        started = time.time()
        code, out, err = _run(command, 150)
        rows[variant] = _last_json(out) or {"error": f"exit {code}: {err[-1500:]}"}
        rows[variant]["seconds"] = round(time.time() - started, 1)
        check.part("peak_memory", rows)
    base = rows["baseline"]
    if "error" in base:
        check.verdict("peak memory", FAIL if cuda else NOT_RUN, f"baseline did not run: {base['error'][-300:]}")
        return
    for variant in VARIANTS[1:]:
        row = rows[variant]
        if "error" in row:
            status = NOT_RUN if any(reason in row["error"] for reason in NOT_RUN_REASONS) else FAIL
            check.verdict(f"peak memory: {variant}", status, row["error"][-300:])
            continue
        status, detail = judge(base, row, layers, cuda)
        check.verdict(f"peak memory: {variant}", status, detail)
        check.part("peak_memory", rows)
    ran = {name: row for name, row in rows.items() if "error" not in row}
    status, detail = judge_estimate(ran, cuda)
    check.verdict("memory estimate vs measured peak", status, detail)


def judge_estimate(rows: dict, cuda: bool) -> tuple[str, str]:
    """The estimate (``megatron_bridge_ext.estimate``) of each variant that ran, against its measured peak.

    With CUDA: every variant's estimate, less what a bare step never allocates (optimizer states), is
    within the estimate's target of ``max_memory_allocated``. Dry run: the estimate ran for every
    variant (the CPU's attention is PyTorch's math fallback, not the fused kernel the estimate assumes,
    so the bytes are not compared).
    """
    problems, lines = [], []
    for name, row in rows.items():
        est = row.get("estimate")
        if not est or "error" in est:
            problems.append(f"{name}: {(est or {}).get('error', 'no estimate in the output')[-200:]}")
        elif cuda:
            lines.append(f"{name} {est['compared_bytes'] / 2**30:.2f} vs {row['peak_forward_backward'] / 2**30:.2f} GiB "
                         f"({est['relative_error']:+.1%})")
            if not est["within_target"]:
                problems.append(f"{name}: {est['relative_error']:+.1%} is outside {est['target']:.0%}")
        else:
            lines.append(f"{name} peak {est['peak_bytes']:,} B")
    if problems:
        return FAIL, "; ".join(problems)
    if not cuda:
        return DRY, "the carried estimate of every variant read (bytes not compared on the CPU's attention): " + ", ".join(lines)
    return PASS, "estimate, less optimizer states, vs max_memory_allocated: " + "; ".join(lines)


def judge(base: dict, row: dict, layers: int, cuda: bool) -> tuple[str, str]:
    """The verdict on one variant's figures against the baseline's, from the shape alone.

    With CUDA: the after-forward drop plus regather's persistent buffer equals 2L adapters' worth
    (within ``TOLERANCE``), and the peak drop plus the buffer lies between 2L-1 and 2L adapters' worth.
    Dry run: the saved-activation drop equals 2L adapters' worth exactly. ``row`` gains the figures.
    """
    adapters = 2 * layers  # linear_qkv and linear_fc1 of every layer
    worth = _adapter_bytes(base["shape"])
    ratio = row["step_time_ms"] / base["step_time_ms"]
    row["step_time_ratio"] = ratio
    timing = (f"step time x{ratio:.3f} of the baseline (compute only: collectives are free on a fake group; "
              f"collective bytes per step {row['collective_bytes_per_step']:,} vs {base['collective_bytes_per_step']:,})")
    if not cuda:
        drop = base["saved_activation_bytes"] - row["saved_activation_bytes"]
        return (DRY if drop == adapters * worth else FAIL,
                f"saved-activation drop {drop:,} B, expected {adapters} x {worth:,} B; {timing}")
    forward_drop = base["memory_after_forward"] - row["memory_after_forward"]
    buffer = row["regather_buffer_bytes"] - base["regather_buffer_bytes"]
    peak_drop = base["peak_forward_backward"] - row["peak_forward_backward"]
    row.update(after_forward_drop=forward_drop, peak_drop=peak_drop, expected_after_forward_drop=adapters * worth)
    forward_ok = abs(forward_drop + buffer - adapters * worth) <= TOLERANCE
    peak_ok = (adapters - 1) * worth - TOLERANCE <= peak_drop + buffer <= adapters * worth + TOLERANCE
    return (PASS if forward_ok and peak_ok else FAIL,
            f"after-forward drop {forward_drop / MiB:.1f} MiB + gather buffer {buffer / MiB:.1f} MiB "
            f"(expected {adapters} x {worth / MiB:.1f} = {adapters * worth / MiB:.1f} MiB); peak drop "
            f"{peak_drop / MiB:.1f} MiB (expected {(adapters - 1) * worth / MiB:.1f}..{adapters * worth / MiB:.1f}); "
            f"{timing}")


def functional(check: Check, gpus: int) -> None:
    if gpus < 2:
        check.verdict("functional tests under NCCL", NA if gpus == 1 else DRY,
                      f"{gpus} GPU(s): two NCCL ranks need two GPUs; run tests/functional on a node with 2 or more")
        return
    try:
        import pytest  # noqa: F401
    except ImportError:
        check.verdict("functional tests under NCCL", NOT_RUN, "pytest is not installed (carry its wheels)")
        return
    code, out, err = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "pytest", "tests/functional", "-q", "-p", "no:cacheprovider"], 300)
    check.part("functional", {"exit": code, "tail": (out + err)[-3000:]})
    check.verdict("functional tests under NCCL", PASS if code == 0 else FAIL, (out.strip().splitlines() or [""])[-1])


def parse_args(argv=None) -> argparse.Namespace:
    """The check's options, refused (exit 2, one line) before any wheel is installed or part started."""
    p = argparse.ArgumentParser(prog="python -m megatron_bridge_ext.device_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "build/device"), help="where device_check.json goes")
    p.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="transformer layers of the Qwen3-8B-shaped stack")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check the path, not the figures")
    p.add_argument("--budget", type=int, default=BUDGET_S, help="wall-clock seconds for the whole check")
    args = p.parse_args(argv)
    if args.layers < 1 or args.budget < 60:
        p.error(f"--layers={args.layers} must be at least 1 and --budget={args.budget} at least 60")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    global _deadline
    _deadline = time.monotonic() + args.budget
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    check = Check(Path(args.out), args.dry_run)
    info = preflight()
    check.part("preflight", info)
    gpu = info["gpu"] or {}
    print(f"preflight: GPU {gpu.get('name', 'none')} ({gpu.get('memory_bytes', 0) / 2**30:.0f} GiB, "
          f"{gpu.get('count', 0)} device(s)); torch {info['torch_runtime']}; megatron-core "
          f"{info['versions']['megatron-core']}; megatron-bridge {info['versions']['megatron-bridge']}; "
          f"commit {info['commit']}", flush=True)
    fragmentation(check, cuda)
    peak_memory(check, args.layers, args.dry_run, cuda)
    one_gpu.part(check, cuda, _run)
    functional(check, torch.cuda.device_count() if cuda else 0)
    failed = check.failed()
    print(f"device check: {len(check.report['verdicts']) - len(failed)} of {len(check.report['verdicts'])} checks "
          f"passed or dry; {check.path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
