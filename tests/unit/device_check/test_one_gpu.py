"""The one-GPU checks: their bounds from the caching allocator's rounding, their verdicts, their part of the device
check, and their CPU rehearsal (``--dry-run``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge_ext.device_check import check, one_gpu

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
MiB = 1 << 20


@pytest.mark.parametrize("nbytes, low, high", [
    (0, 0, 0),  # an empty tensor takes no block
    (1, 512, 512),  # round_size: below kMinBlockSize, one 512-byte block
    (512, 512, 512),
    (513, 1024, 1024),  # rounded up to the next multiple of 512
    (MiB, MiB, MiB),  # the largest small-pool request: blocks split down to 512 B, so exact
    (MiB + 1, MiB + 512, MiB + 512 + MiB - 1),  # large pool: a remainder of up to 1 MiB stays in the block
])
def test_a_requests_block_follows_the_caching_allocators_rounding(nbytes, low, high):
    assert one_gpu.block_bounds(nbytes) == (low, high)


def _meter_row(grown: int, sizes=(8192, 100, 1024)) -> dict:
    return {"allocated_before_forward": 3 * MiB, "allocated_after_forward": 3 * MiB + grown,
            "saved_storage_bytes": list(sizes)}


def test_the_meter_verdict_wants_the_blocks_of_the_saved_storages_and_the_loss():
    blocks = 8192 + 512 + 1024 + 512  # 100 B and the 4-byte loss take a 512-byte block each
    assert one_gpu.judge_meter(_meter_row(blocks))[0] is True
    for grown in (blocks - 512, blocks + 512):  # a storage the meter counts but nothing holds, or one it misses
        assert one_gpu.judge_meter(_meter_row(grown))[0] is False, grown
    ok, detail = one_gpu.judge_meter(_meter_row(blocks))
    assert detail == ("memory_allocated grew 10,240 B over forward; the meter's 3 storages (9,316 B) and the loss "
                      "take 10,240 B in 512-byte blocks")


GRID_TP2 = {"seq": 32, "micro_batch": 2, "hidden": 64, "tp": 2, "dtype": "bfloat16", "layers": 2}


def _saving_rows(drop: int, shape=GRID_TP2) -> tuple[dict, dict]:
    base = {"shape": shape, "memory_before_step": 5 * MiB, "memory_after_forward": 6 * MiB}
    return base, dict(base, memory_after_forward=base["memory_after_forward"] - drop)


def test_the_saving_verdict_wants_one_gathered_block_less_one_shard_block_per_adapter():
    # bf16 [32, 2, 64] = 8192 B gathered, 4096 B a shard (both multiples of 512): 4 adapters x 4096 B exactly,
    # which is also 2L x s*b*h*bytes*(1-1/t)
    exact = 2 * 2 * (8192 - 4096)
    assert one_gpu.saving_bounds(GRID_TP2) == (exact, exact)
    assert one_gpu.judge_saving(*_saving_rows(exact))[0] is True
    for drop in (exact - 512, exact + 512, 0):
        assert one_gpu.judge_saving(*_saving_rows(drop))[0] is False, drop


def test_a_large_gathered_input_widens_the_bound_by_the_large_pools_remainder():
    shape = dict(GRID_TP2, seq=8192, hidden=4096, micro_batch=1)  # 64 MiB gathered, 32 MiB a shard
    gathered, shard, adapters = 8192 * 4096 * 2, 8192 * 4096, 4
    assert one_gpu.saving_bounds(shape) == (adapters * (gathered - shard - MiB + 1),
                                            adapters * (gathered + MiB - 1 - shard))


class _Report:
    def __init__(self):
        self.parts, self.verdicts = {}, []

    def part(self, name, data):
        self.parts[name] = data

    def verdict(self, name, status, detail):
        self.verdicts.append((name, status, detail))


def test_the_part_gives_each_check_its_verdict_and_a_failed_run_fails():
    answers = {"meter": (0, json.dumps({"status": check.PASS, "detail": "grew 10,240 B"}), ""),
               "lora_saving": (1, "", "Traceback ...\nRuntimeError: no GPU")}
    commands = []

    def run(command, timeout):
        commands.append(command)
        return answers[command[command.index("--check") + 1]]

    report = _Report()
    one_gpu.part(report, cuda=False, run=run)
    assert all(c[:3] == [sys.executable, "-m", "megatron_bridge_ext.device_check.one_gpu"] and "--dry-run" in c
               for c in commands)
    assert [(name, status) for name, status, _ in report.verdicts] == [
        (one_gpu.NAMES["meter"], check.PASS), (one_gpu.NAMES["lora_saving"], check.FAIL)]
    assert "RuntimeError: no GPU" in report.verdicts[1][2]
    assert report.parts["one_gpu"]["lora_saving"]["error"].startswith("exit 1: ")


def test_an_unknown_check_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exited:
        one_gpu.main(["--check", "peak"])
    assert exited.value.code == 2
    assert "--check: invalid choice: 'peak'" in capsys.readouterr().err


@pytest.mark.parametrize("name", one_gpu.CHECKS)
def test_the_cpu_rehearsal_runs_the_path_and_states_the_gpus_bound(name):
    """``--dry-run`` in a fresh process, as the device check starts it: the meter's storages and their blocks, and
    the saving as the meter sees it (exactly 2L x s*b*h*bytes*(1-1/t) on the grid's TP=2 shape)."""
    done = subprocess.run([sys.executable, "-m", "megatron_bridge_ext.device_check.one_gpu", "--check", name,
                           "--dry-run", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["status"] == check.DRY, row["detail"]
    if name == "meter":
        assert sum(row["saved_storage_bytes"]) == row["saved_activation_bytes"] > 0
    else:
        shape = row["baseline"]["shape"]
        drop = row["baseline"]["saved_activation_bytes"] - row["shard_local"]["saved_activation_bytes"]
        assert drop == 2 * shape["layers"] * shape["seq"] * shape["micro_batch"] * shape["hidden"] * 2 // 2
        assert f"drop must be {drop:,} B" in row["detail"]
