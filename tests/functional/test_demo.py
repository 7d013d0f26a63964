"""The main job's building blocks on 2 ranks: one training run per variant and the table."""

import torch

from megatron_bridge_ext.demo import tiny_model, train, variants


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
    table = train.format_table(shape, [base, local], "2 ranks")
    lines = table.splitlines()
    assert [line.split()[1] for line in lines[3:]] == ["baseline", "shard_local"]
