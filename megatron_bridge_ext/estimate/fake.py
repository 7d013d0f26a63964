"""A fake parallel world in which one process builds and runs a rank's real model on fake tensors.

The estimate runs Megatron Core's own layers under torch's ``FakeTensorMode``: every tensor has a
shape, dtype and device but no data, so a Qwen3-8B layer at sequence 8192 "runs" in well under a
second on a CPU, with or without a GPU. Collectives go through torch's ``fake`` process-group
backend, which returns correctly shaped outputs: this process sees exactly the shapes rank
``rank`` of a TP x PP x CP job sees (its sequence shard, its vocabulary slice, its layers; with
experts, its EP x ETP share of them, the world being as large as the expert grid needs).

:func:`fake_parallel_world` sets that up and, on exit, puts back everything it changed, so that it
can run inside a process that already has a real process group and Megatron parallel state (a
training script, the functional tests): torch.distributed's group registry, Megatron Core's
parallel-state globals, Core's MoE and multi-token prediction metrics trackers, the RNG tracker, the process's RNG
state, ``torch.cuda.current_device``, the causal-mask builder and the dynamo switch.

Why each change (all undone on exit; none of them outlives the context):

* Megatron's RNG tracker: ``CudaRNGStatesTracker.fork`` compares CPU RNG states with ``.item()``,
  which needs data. The RNG changes no shape, so a tracker whose ``fork`` does nothing stands in.
  Activation checkpointing records RNG states in forward; without CUDA it gets the CPU state.
* ``torch.cuda.current_device``: Megatron allocates collective outputs and its global memory buffer
  on it. It must name the traced device (fake CUDA tensors need no GPU).
* the causal mask: Megatron Core builds a new [s, s] mask per layer (not cached) on CUDA and the
  unfused softmax keeps it; the trace builds it the same way on the traced device (the CPU
  emulation of the demo and the tests does the same on CPU ranks).
* Transformer Engine's attention variables (``NVTE_FLASH_ATTN``, ...): building a Megatron model
  asserts and sets them from ``attention_backend``; the trace starts without them and the caller's
  values come back afterwards.
* FP8 state: Megatron Core 0.19's ``CheckpointWithoutOutput`` (``layernorm`` recompute) calls
  Transformer Engine's ``FP8GlobalStateManager`` and ``activation_recompute_forward``, names its
  module only has with TE installed (its ``fp8 is not None`` test is always true). The trace runs
  no FP8 kernel (FP8 is modelled by contract, :mod:`.te_fp8`), so without TE stand-ins that say "FP8
  off" and enter no context take their place.
* ``te_checkpoint``: under FP8 Core recomputes an MLP, and under full recompute each chunk of layers, through TE's
  checkpoint, which raises (or is None) without TE; Core's own checkpoint, which keeps the same inputs, stands in
  while tracing.
* dynamo off: Megatron's ``jit_fuser`` is ``torch.compile``, which would try to compile for a GPU
  that is not there. Eager regions save what their ops save; a compiled region's partitioner may
  choose differently (listed in the estimate's assumptions).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

# Group names of the fake world start this far above the real world's counter, so that they cannot
# collide with names the real groups hold in torch's C++ group registry.
_GROUP_NAME_OFFSET = 1_000_000

_C10D_GLOBALS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag",
                 "_group_count", "_backend", "_default_pg_init_method")


def ranks_per_stage(*, tp: int, cp: int, ep: int = 1, etp: int = 1) -> int:
    """Ranks of one pipeline stage in the fake world: the fewest that both Megatron Core's dense grid
    (TP x CP x DP) and its expert grid (ETP x EP x expert-DP) divide into whole groups, i.e. the least
    common multiple of TP x CP and ETP x EP (the dense DP this adds only shapes the groups)."""
    import math

    return math.lcm(tp * cp, ep * etp)


@contextlib.contextmanager
def fake_parallel_world(*, tp: int, pp: int, cp: int, rank: int, device: str, ep: int = 1,
                        etp: Optional[int] = None) -> Iterator[None]:
    """This process is global rank ``rank`` of a fake world of ``pp`` stages of :func:`ranks_per_stage`
    ranks each, with Megatron Core's parallel state for it (expert groups included), tracing on ``device``.

    The dense DP of the fake world is whatever the expert layout needs (1 without experts): the real DP
    only shards optimizer state, a formula. ``etp`` None: Core's default, TP.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_bridge_ext.patches import core_local_norm_sequence_parallel

    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    etp = etp or tp
    world = pp * ranks_per_stage(tp=tp, cp=cp, ep=ep, etp=etp)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_isolated_c10d())
        stack.enter_context(_isolated_parallel_state())
        stack.enter_context(_isolated_moe_metrics())
        stack.enter_context(_isolated_mtp_metrics())
        stack.enter_context(_rng_for_tracing())
        stack.enter_context(current_device(device))
        stack.enter_context(_causal_mask(device))
        stack.enter_context(_dynamo_disabled())
        stack.enter_context(_attention_environment())
        stack.enter_context(_fp8_state_without_te())
        stack.enter_context(_te_checkpoint_without_te())
        stack.enter_context(scoped_patch(core_local_norm_sequence_parallel.PATCH))
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, create_gloo_process_groups=False)
        yield


@contextlib.contextmanager
def _isolated_c10d() -> Iterator[None]:
    """Set torch.distributed's group registry aside (a real world, if any) and restore it afterwards.

    The registry lives in module globals of ``torch.distributed.distributed_c10d`` and in the
    default group of its ``_world``; the fake groups' names are removed from the C++ registry on exit.
    ``init_process_group`` also wraps ``sys.excepthook`` to prefix tracebacks with ``[rankN]:``
    (``torch/distributed/distributed_c10d.py``, torch 2.14): it is put back, or every world would nest one more
    prefix.
    """
    import sys

    from torch.distributed import distributed_c10d as c10d

    saved_hook = sys.excepthook
    saved = {name: getattr(c10d, name) for name in _C10D_GLOBALS}
    saved_default, saved_coalesce = c10d._world._default_pg, c10d._world._pg_coalesce_state
    for name in _C10D_GLOBALS[:6]:
        setattr(c10d, name, {})
    c10d._group_count = saved["_group_count"] + _GROUP_NAME_OFFSET
    c10d._world._default_pg, c10d._world._pg_coalesce_state = None, {}
    try:
        yield
    finally:
        for group, name in list(c10d._pg_names.items()):
            group.shutdown()
            c10d._unregister_process_group(name)
        for name, value in saved.items():
            setattr(c10d, name, value)
        c10d._world._default_pg, c10d._world._pg_coalesce_state = saved_default, saved_coalesce
        sys.excepthook = saved_hook


@contextlib.contextmanager
def _isolated_parallel_state() -> Iterator[None]:
    """Set Megatron Core's parallel state (groups, ranks, sizes, global memory buffer: module globals
    of ``parallel_state``) aside, start from none, and restore every global to its value on entry.

    ``destroy_model_parallel`` only resets the globals (and destroys gloo groups registered in the
    current, here isolated, torch.distributed registry), so it never touches a real world's groups.
    """
    import types

    from megatron.core import parallel_state

    saved = {name: value for name, value in vars(parallel_state).items()
             if not name.startswith("__") and not callable(value) and not isinstance(value, types.ModuleType)}
    parallel_state.destroy_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        for name, value in saved.items():
            setattr(parallel_state, name, value)


@contextlib.contextmanager
def _isolated_moe_metrics() -> Iterator[None]:
    """A fresh MoE metrics tracker (Core's module global in ``transformer/moe/moe_logging.py``) for the trace,
    and the caller's back afterwards: the router records its auxiliary losses there, sized by the layers
    of the first model that recorded, so neither a real run's tracker nor another trace's may be touched."""
    from megatron.core.transformer.moe import moe_logging

    saved = moe_logging._MOE_METRICS_TRACKER
    moe_logging._MOE_METRICS_TRACKER = None
    try:
        yield
    finally:
        moe_logging._MOE_METRICS_TRACKER = saved


@contextlib.contextmanager
def _isolated_mtp_metrics() -> Iterator[None]:
    """A fresh multi-token prediction metrics tracker (``MTPLossLoggingHelper.tracker``, a class global of Core's
    ``transformer/multi_token_prediction.py`` L345 that ``process_mtp_loss`` adds each depth's loss to, sized by
    the first model's depths, L373-378) for the trace, and the caller's back afterwards, as for the MoE tracker."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    saved = MTPLossLoggingHelper.tracker
    MTPLossLoggingHelper.tracker = {}
    try:
        yield
    finally:
        MTPLossLoggingHelper.tracker = saved


class _TracingRNGTracker:
    """Stands in for Megatron's CUDA RNG tracker while tracing: no state, ``fork`` does nothing."""

    def fork(self, name=None):
        return contextlib.nullcontext()

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    def add(self, name, seed):
        pass

    def reset(self):
        pass


@contextlib.contextmanager
def _rng_for_tracing() -> Iterator[None]:
    from megatron.core.tensor_parallel import random as core_random

    saved = (core_random._CUDA_RNG_STATE_TRACKER, core_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
             core_random._get_cuda_rng_state, core_random._set_cuda_rng_state)
    cpu_state = torch.get_rng_state()
    core_random._CUDA_RNG_STATE_TRACKER, core_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _TracingRNGTracker(), True
    if not torch.cuda.is_available():
        core_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        core_random._set_cuda_rng_state = lambda *args, **kwargs: None
    try:
        yield
    finally:
        (core_random._CUDA_RNG_STATE_TRACKER, core_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
         core_random._get_cuda_rng_state, core_random._set_cuda_rng_state) = saved
        torch.set_rng_state(cpu_state)


@contextlib.contextmanager
def current_device(device: str) -> Iterator[None]:
    """``torch.cuda.current_device`` names ``device`` (``"cuda"``: device 0, real where a GPU is present)."""
    if device == "cuda" and torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = (lambda: 0) if device == "cuda" else (lambda: "cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = saved


@contextlib.contextmanager
def _causal_mask(device: str) -> Iterator[None]:
    """A new mask per call, as Megatron Core builds it, on the traced device (Core's names CUDA)."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    def mask(sq: int) -> torch.Tensor:
        return torch.ones(sq, sq, dtype=torch.bool, device=device).triu(1)

    saved = transformer_utils.get_default_causal_mask, fused_softmax.get_default_causal_mask
    transformer_utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = mask
    try:
        yield
    finally:
        transformer_utils.get_default_causal_mask, fused_softmax.get_default_causal_mask = saved


class _NoFP8:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def _no_te_context(*args, **kwargs):
    return contextlib.nullcontext()


# What Megatron Core's random.py imports from TE, each standing in for "TE off".
_TE_NAMES_IN_RANDOM = {"FP8GlobalStateManager": _NoFP8, "activation_recompute_forward": _no_te_context,
                       "fp8_autocast": _no_te_context}


@contextlib.contextmanager
def _fp8_state_without_te() -> Iterator[None]:
    from megatron.core.tensor_parallel import random as core_random

    missing = {name: value for name, value in _TE_NAMES_IN_RANDOM.items() if not hasattr(core_random, name)}
    for name, value in missing.items():
        setattr(core_random, name, value)
    try:
        yield
    finally:
        for name in missing:
            delattr(core_random, name)


def _checkpoint_as_te_does(forward_func, distribute_saved_activations, get_rng_state_tracker, tp_group, *args,
                           **kwargs):
    """Core's own activation checkpoint in place of ``te_checkpoint``: TE's ``distributed.checkpoint`` (a reentrant
    checkpoint, as Core's ``CheckpointFunction``) keeps the same inputs for backward and recomputes the same forward."""
    import functools

    from megatron.core import tensor_parallel

    return tensor_parallel.checkpoint(functools.partial(forward_func, **kwargs), distribute_saved_activations, *args)


@contextlib.contextmanager
def _te_checkpoint_without_te() -> Iterator[None]:
    """Megatron Core recomputes a layer's MLP under FP8 through ``te_checkpoint`` (Core 0.19.2
    ``transformer/transformer_layer.py:882-893``, ``_forward_mlp``: ``if self.config.fp8 or self.config.fp4``;
    ``extensions/transformer_engine.py:3291-3314``), which raises without Transformer Engine; full recompute runs
    each chunk of layers through the same function (``recompute.py`` L130-140, ``chunk_runner``), which that module
    imports only with TE (L15-18: None without it, so a full-recompute FP8 trace called None). TE's
    ``transformer_engine/pytorch/distributed.py`` ``checkpoint`` (reentrant by default,
    ``_USE_REENTRANT_ACTIVATION_RECOMPUTE``) keeps the function's tensor inputs and reruns its forward in backward,
    as Core's ``CheckpointFunction`` does; the estimate traces FP8 configs on the local spec, so Core's checkpoint
    stands in for it while tracing."""
    from megatron.core.extensions import transformer_engine as core_te

    if core_te.HAVE_TE:
        yield
        return
    from megatron.core import recompute

    from megatron_bridge_ext.estimate.standins import replaced_attributes

    with replaced_attributes({(core_te, "te_checkpoint"): _checkpoint_as_te_does,
                              (recompute, "te_checkpoint"): _checkpoint_as_te_does}):
        yield


_ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@contextlib.contextmanager
def _attention_environment() -> Iterator[None]:
    import os

    saved = {name: os.environ.pop(name, None) for name in _ATTENTION_VARIABLES}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _dynamo_disabled() -> Iterator[None]:
    import torch._dynamo

    saved = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        yield
    finally:
        torch._dynamo.config.disable = saved


@contextlib.contextmanager
def scoped_patch(patch) -> Iterator[None]:
    """Apply ``patch`` for the duration (left applied if it already was)."""
    was_applied = patch.applied
    patch.apply(quiet=True)
    try:
        yield
    finally:
        if not was_applied:
            patch.revert()
