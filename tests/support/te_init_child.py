"""One rank of a training script that calls ``megatron_bridge_ext.init()`` before it imports Bridge.

    python -m tests.support.te_init_child OUT.json      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Transformer Engine 2.4 is simulated (its installed version, and the fake's ``te>=2.4`` contract);
``init()`` runs first, then Bridge's PEFT modules import, then Bridge's own ``LoRA`` wraps the fake
TE LayerNorm-linear (TP=2, sequence parallelism) and one forward and backward are compared with the
dense float64 reference (:func:`megatron_bridge_ext.levers.lora_input.te_check.run_one`, patch left as init() left
it). Writes the relative errors and what was imported when to ``OUT.json`` (rank 0).
"""

from __future__ import annotations

import json
import sys


def main(out: str) -> None:
    from megatron_bridge_ext.testing import cpu_emulation

    cpu_emulation.install()
    import torch
    from packaging.version import Version

    import megatron_bridge_ext
    from megatron_bridge_ext import versions
    from megatron_bridge_ext.levers import allocator

    real = versions.installed_version
    versions.installed_version = lambda name: Version("2.4.0") if name == "transformer-engine" else real(name)
    allocator.init = lambda **options: None  # this run is about the patches, not the process's allocator
    megatron_bridge_ext.init()
    bridge_before = sorted(name for name in sys.modules if name.startswith("megatron.bridge"))

    from megatron.core import parallel_state

    from megatron_bridge_ext.levers.lora_input import te_check
    from megatron_bridge_ext.testing import distributed
    from tests.support.fake_te import TE_GE_2_4, FakeTELayerNormColumnParallelLinear, see_fake_te
    from tests.support.lora_blocks import B, H, OUT, S, _parallel_config

    see_fake_te(TE_GE_2_4)
    distributed.init_from_env(tensor_parallel=2)
    group = parallel_state.get_tensor_model_parallel_group()

    def make_base():
        return FakeTELayerNormColumnParallelLinear(H, OUT, config=_parallel_config(torch.float64),
                                                   tp_group=group, te_contract=TE_GE_2_4, seed=9)

    result = te_check.run_one(make_base, "bridge", group, seq=S, batch=B, hidden=H, out_features=OUT, as_is=True)
    from megatron.bridge.peft.lora import LoRA

    if group.rank() == 0:
        with open(out, "w") as f:
            json.dump({"bridge_before_init": bridge_before, "errors": result.errors,
                       "nonzero": result.reference_nonzero, "lora": f"{LoRA.__module__}.{LoRA.__qualname__}"}, f)


if __name__ == "__main__":
    main(sys.argv[1])
