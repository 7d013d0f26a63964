"""Process-group and model-parallel setup shared by the demo, the benchmarks and the tests."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("MBX_DIST_TIMEOUT_S", "300")))


def backend_for_device() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(tensor_parallel: int, seed: int = 1234, expert_parallel: int = 1,
                  expert_tensor_parallel: int | None = None) -> None:
    """Initialise torch.distributed from torchrun's variables and Megatron Core's parallel state.

    ``expert_parallel`` and ``expert_tensor_parallel`` are Megatron Core's expert layout, folded onto the
    same ranks as the dense one (``expert_tensor_parallel`` None: Core's default, the TP size).
    Idempotent for the same layout. On CUDA each rank takes ``LOCAL_RANK`` as its device.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend_for_device(), timeout=DEFAULT_TIMEOUT)
    layout = (tensor_parallel, expert_parallel, expert_tensor_parallel or tensor_parallel)
    if parallel_state.model_parallel_is_initialized():
        if _current_layout() == layout:
            return
        destroy_model_parallel()
    world = dist.get_world_size()
    if world % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide the world size {world}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             expert_model_parallel_size=expert_parallel,
                                             expert_tensor_parallel_size=expert_tensor_parallel)
    model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Megatron Core's ``destroy_model_parallel``, then every process group but the default one destroyed.

    Core's destroy drops its references to its groups but destroys only its gloo-specific ones
    (``parallel_state.destroy_model_parallel``, Core 0.19); the rest stay registered with torch.distributed. Under
    gloo each keeps its transport threads (``gloo_tcp_loop``), which poll: every new layout and every Bridge run
    in one process left hundreds behind, and on a 2-core machine they took the CPU from the tests. Groups held
    outside Core's parallel state are destroyed too, so callers take their groups from the parallel state after
    this, never from before."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    destroy_groups()


def destroy_groups() -> None:
    """Every process group registered with torch.distributed except the default (world) one, destroyed."""
    if not dist.is_initialized():
        return
    world = dist.distributed_c10d._get_default_group()
    for group in [g for g in dist.distributed_c10d._world.pg_map if g is not world]:
        dist.destroy_process_group(group)


def _current_layout() -> tuple[int, int, int]:
    """(TP, EP, expert TP) of Megatron Core's parallel state as initialised."""
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size())


def device() -> torch.device:
    """The device this rank computes on."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
