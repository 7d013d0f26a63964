"""How `mbx diagnose` reads large inputs: a directory of 1,000 rank logs and one 1 GB merged log.

    .venv/bin/python scripts/diagnose_stream_bench.py [--size-gb 1.0] [--ranks 1000] [--keep DIR]

Writes both inputs into a temporary folder (written as streams too), runs ``mbx diagnose`` on each in
a child process and prints its wall time and peak resident memory (``getrusage`` of the child). A
reader that held the file whole would need more than the file's size; a streaming one stays at the
interpreter's size. Figures are of this machine: the output names it.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _builders():
    """tests/support/oom_logs.py, loaded by its path: the lines as upstream prints them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("oom_logs", ROOT / "tests" / "support" / "oom_logs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


L = _builders()
GIB, MIB = L.GIB, L.MIB
allocator_oom, bridge_memory_line, bridge_stats, prefixed, traceback = (
    L.allocator_oom, L.bridge_memory_line, L.bridge_stats, L.prefixed, L.traceback)

GB = 10**9
STEP = ("iteration {i:8d}/ 1000000 | consumed samples: {s:12d} | elapsed time per iteration (ms): 1234.5 | "
        "learning rate: 1.000000E-04 | global batch size: 128 | lm loss: 2.345678E+00 | loss scale: 1.0 |")


def write_big_log(path: Path, size: int, world: int) -> int:
    """Step lines of every rank, memory reports after iterations 1 and 2, one OOM at the end; returns lines."""
    lines = 0
    with open(path, "w") as f:
        for it in (1, 2):
            for rank in range(world):
                if (rank // 2) % 2:  # TP 2 x DP 2 x PP 2: Bridge reports on data-parallel rank 0 only
                    continue
                f.write(prefixed(rank, bridge_memory_line(rank, it, bridge_stats(GB, (30 + it) * GB, 40 * GB, 41 * GB)))
                        + "\n")
                lines += 1
        i = 0
        while f.tell() < size:
            for rank in range(world):
                f.write(prefixed(rank, STEP.format(i=i, s=i * 128)) + "\n")
            lines += world
            i += 1
        message = allocator_oom(2 * GIB, total=80 * GIB, free=100 * MIB, allocated=60 * GIB, reserved=79 * GIB)
        for line in traceback(message):
            f.write(prefixed(3, line) + "\n")
            lines += 1
    return lines


def write_rank_dir(folder: Path, ranks: int) -> None:
    folder.mkdir()
    for rank in range(ranks):
        with open(folder / f"rank{rank:04d}.log", "w") as f:
            for i in range(200):
                f.write(STEP.format(i=i, s=i * 128) + "\n")
            if rank % 8 == 0:
                f.write(bridge_memory_line(rank, 1, bridge_stats(GB, 30 * GB + rank * 10**6, 40 * GB, 41 * GB)) + "\n")


def measure(args: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak RSS (MiB) and exit status of ``mbx diagnose ARGS`` in a child process of its own
    (``os.wait4`` gives that child's resource usage alone)."""
    began = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen([sys.executable, "-m", "megatron_bridge_ext.cli", "diagnose", *args, "--json"],
                                 cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - began
        if child.returncode:
            err.seek(0)
            print(err.read().decode(), file=sys.stderr)
    return wall, usage.ru_maxrss / 1024, child.returncode  # ru_maxrss is in KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="size of the merged log in GB (default 1.0)")
    parser.add_argument("--ranks", type=int, default=1000, help="number of per-rank logs (default 1000)")
    parser.add_argument("--keep", help="write the inputs here and keep them (default: a temporary folder)")
    args = parser.parse_args()
    folder = Path(args.keep or tempfile.mkdtemp(prefix="mbx-diagnose-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"python {platform.python_version()}")
    rank_dir = folder / "ranks"
    if not rank_dir.exists():
        write_rank_dir(rank_dir, args.ranks)
    wall, rss, status = measure([str(rank_dir), "--tp", "8", "--pp", str(args.ranks // 8)])  # DP 1: every stage reports
    size = sum(p.stat().st_size for p in rank_dir.iterdir())
    print(f"{args.ranks} rank logs ({size / 1e6:.1f} MB): {wall:.1f} s, peak RSS {rss:.0f} MiB, exit {status}")
    big = folder / "merged.log"
    lines = write_big_log(big, int(args.size_gb * GB), world=8)
    wall, rss, status = measure([str(big), "--tp", "2", "--pp", "2", "--dp", "2"])
    print(f"one merged log of {big.stat().st_size / 1e9:.2f} GB ({lines:,} lines): {wall:.1f} s, peak RSS "
          f"{rss:.0f} MiB, exit {status}")
    if not args.keep:
        for path in sorted(folder.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        folder.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
