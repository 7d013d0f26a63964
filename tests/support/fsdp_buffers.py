"""Megatron Core's own Megatron-FSDP buffers (``ParamAndGradBuffer``) over a real model on this rank of the world's
data-parallel group (gloo on CPU under the test-support emulation, NCCL on GPUs): each buffer's elements and dtype."""

from __future__ import annotations

import torch

KINDS = ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer")


def fsdp_buffers(model, strategy: str) -> dict:
    """``ParamAndGradBuffer`` as ``MegatronFSDP`` builds it for ``strategy`` (transformer layers as units under
    ``optim_grads_params``, fp32 main weights, Core's default ``MixedPrecisionPolicy``): per kind, the (elements, dtype)
    of each group's buffer on this rank (None where the group has none), and the optimizer's elements. The DTensor
    shard check (``validate_uneven_dtensor``) runs on CUDA only and allocates nothing: it is skipped on CPU."""
    from torch.distributed.device_mesh import DeviceMesh

    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as core
    from megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision import MixedPrecisionPolicy
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex
    from megatron.core.transformer.transformer_layer import TransformerLayer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        core.validate_uneven_dtensor = lambda tensor: None
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
    world = torch.distributed.get_world_size()
    mesh = DeviceMesh(device, [[rank] for rank in range(world)], mesh_dim_names=("dp_cp", "tp"))
    units = [TransformerLayer] if strategy == "optim_grads_params" else []
    buffer = core.ParamAndGradBuffer(ddp, model, core.BucketingPolicy(suggested_bucket_size=None,
                                                                      fsdp_unit_modules=units),
                                     FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_cp", tp_dim="tp"),
                                     MixedPrecisionPolicy(main_params_dtype=torch.float32), device=torch.device(device))
    out = {kind: [_held(getattr(group, kind)) for group in buffer.parameter_groups] for kind in KINDS}
    out["optimizer"] = sum(p.to_local().numel() for _, p in buffer.optimizer_named_parameters)
    return out


def _held(buffer):
    if buffer is None or getattr(buffer, "data", None) is None:
        return None
    return buffer.data.numel(), buffer.data.element_size()


def held_bytes(measured: dict, kind: str) -> int:
    return sum(n * size for n, size in (b for b in measured[kind] if b is not None))
