"""The main job's building blocks on 2 ranks: one training run per variant and the table."""

import torch

from megatron_bridge_ext.demo import train
from megatron_bridge_ext.testing import tiny_model, variants


class _Progress:
    def __init__(self):
        self.count = 0

    def update(self, n):
        self.count += n


def test_demo_rows_show_the_lora_input_saving(tp2):
    shape = tiny_model.TinyGPTShape()
    progress = _Progress()
    rows = {name: train.train_variant(shape, variants.VARIANTS[name], steps=2, progress=progress)
            for name in ("baseline", "shard_local")}
    assert progress.count == 4
    base, local = rows["baseline"], rows["shard_local"]
    assert sum(base["split"].values()) == base["saved_bytes_per_step"][-1]
    # 2 layers x 2 eligible adapters (qkv, fc1) each stop retaining (t-1)/t of an [s, b, h] fp32 tensor.
    element = torch.finfo(torch.float32).bits // 8
    expected_saving = shape.layers * 2 * shape.seq * shape.micro_batch * shape.hidden * element // 2
    assert base["saved_bytes_per_step"][-1] - local["saved_bytes_per_step"][-1] == expected_saving
    assert abs(base["losses"][-1] - local["losses"][-1]) < 1e-5 * abs(base["losses"][-1])
    assert base["losses"][-1] < base["losses"][0]  # the adapters learn
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [base, local])
    rows = [r for per_rank in everyone for r in per_rank]
    lines = train.format_table(shape, rows, "2 ranks").splitlines()
    body, legend = lines[3:-1], lines[-1]
    assert [line.split()[0] for line in body] == ["baseline", "shard_local"]  # rank 0's rows only
    assert all(line.endswith("same") for line in body)  # TP ranks report the same figures
    assert f"  {expected_saving:,} B (" in body[1] and legend.startswith("saving vs baseline:")
    edited = [dict(r, saved_bytes_per_step=[1]) if r["rank"] == 1 and r["variant"] == "shard_local" else r for r in rows]
    body = train.format_table(shape, edited, "2 ranks").splitlines()[3:-1]
    assert body[0].endswith("same") and body[1].endswith("DIFFER: rank 1")


def test_bench_run_measures_every_variant_against_the_baseline(tp2):
    from megatron_bridge_ext.demo import bench

    shape = tiny_model.TinyGPTShape()
    result = bench.run(shape, ["baseline", "regather", "shard_local"], steps=1)
    rows = {r["name"]: r for r in result["variants"]}
    element = 4  # float32
    saving = shape.layers * 2 * shape.seq * shape.micro_batch * shape.hidden * element // shape.tp
    problems = []
    for name in ("regather", "shard_local"):
        if rows["baseline"]["saved_bytes"] - rows[name]["saved_bytes"] != saving:
            problems.append(f"{name}: saved {rows[name]['saved_bytes']} vs baseline {rows['baseline']['saved_bytes']}")
        if rows["baseline"]["lora_input_saved_bytes"] - rows[name]["lora_input_saved_bytes"] != saving:
            problems.append(f"{name}: LoRA-A input bytes do not drop by {saving}")
    if rows["regather"]["parity_max_rel_err"] != 0.0:
        problems.append("regather is bitwise equal to the baseline")
    if not rows["shard_local"]["parity_max_rel_err"] < 1e-5:
        problems.append(f"shard_local parity {rows['shard_local']['parity_max_rel_err']}")
    if rows["shard_local"]["collective_elements"]["total"] >= rows["baseline"]["collective_elements"]["total"]:
        problems.append("shard_local moves fewer collective elements than the baseline")
    text = bench.format_table(result)
    if [line.split()[0] for line in text.splitlines()[3:6]] != ["baseline", "regather", "shard_local"]:
        problems.append(f"table rows: {text}")
    from tests.support.dist_checks import assert_no_problems

    assert_no_problems(problems, tp2)


def test_other_ranks_log_warnings_only(tp2, monkeypatch):
    import logging
    import os

    from megatron_bridge_ext import logs

    logs.configure()
    level = logging.getLogger("megatron_bridge_ext").level
    expected = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    from tests.support.dist_checks import assert_no_problems

    assert_no_problems([] if level == expected else [f"level {level} on rank {os.environ.get('RANK')}"], tp2)
