"""Fine-grained activation offloading (Megatron Core 0.19 ``fine_grained_activation_offloading``): what leaves the GPU.

How Core does it (``pipeline_parallel/fine_grained_activation_offload.py``, "offload.py" below):

* each offloaded module runs inside ``FineGrainedActivationOffloadingInterface`` (L1356-1375): its ``__enter__`` opens
  a *group* named after the module (``on_group_start_forward``, L1170-1190) and enters saved-tensor hooks
  (L779-791) whose pack hands every saved tensor to the group (``tensor_push``, L960-970) instead of autograd; the
  module's ``group_offload`` (L1412-1417) closes it after the module's forward, where ``bulk_offload_group``
  (L1002-1026) copies each tensor that ``tensor_need_offloading_checker`` (L986-1000) admits: not a parameter, at
  least ``min_offloaded_tensor_size`` elements, not marked ``_do_not_offload`` / ``_TE_do_not_offload``;
* the copy goes to pinned host memory (``offload``, L831-847: a shared pinned pool, or ``torch.empty(...,
  pin_memory=True)`` for the MoE groups, L364-367) on a side stream; the group then holds the host copy only, so the
  GPU storage goes once no one else holds it (``forced_released_tensors`` resize the storages the forward still
  references, L1099-1106: the residual of ``attn_norm``/``mlp_norm``, ``core_attn``'s output for ``attn_proj``);
* backward reloads a group into a fresh GPU tensor (``reload``, L849-861) one group ahead of its use
  (``bulk_reload``, L1131-1146);
* the first iteration offloads every group (``should_bulk_offload``, L1066-1087: warmup); after it
  (``post_warmup_callback``, L566-650) the last group of each name of the first chunk to run backward stays on the
  GPU (L582-598: its reload would block the compute stream), the first pipeline ranks keep
  ``pp_rank x delta_offload_bytes_across_pp_ranks`` bytes (L600-611), and of each chunk's remaining groups with
  bytes the last ``int(n x (1 - activation_offload_fraction))`` in forward order stay (L612-628).

Core's hooks refuse fake tensors (``_can_manage_tensor_for_offload``, L945-958) and need CUDA streams, so the trace
runs the modules under :func:`recording`: Core's interface with its hooks replaced by ours, which take a tensor Core
would offload away from the saved-tensor meter (it leaves the GPU) and hand every other one to the meter. The
steady-state policy is then applied to the recorded groups (:func:`kept`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional
from unittest import mock

import torch

from megatron_bridge_ext.estimate.features import expert_offload
from megatron_bridge_ext.estimate.report import ACTIVATIONS, TRANSIENT, Component
from megatron_bridge_ext.findings import ERROR, Finding
from megatron_bridge_ext.measure import ModuleStack

SETTING = "model.fine_grained_activation_offloading"


@dataclasses.dataclass(frozen=True)
class Group:
    """One offload group of a traced microbatch, in forward order.

    ``storages``: ``(key, bytes)`` of the storages it offloads that no save outside the groups holds on the GPU (a
    storage two groups save, ``core_attn``'s output that ``attn_proj`` saves again, is in both: it leaves the GPU only
    when both are offloaded); ``host_bytes``: Core's ``total_offload_bytes`` (``update_offload_info``, offload.py
    L394-397: numel x element size of every offloaded tensor, once per group that saves it), the pinned host memory
    the group takes."""

    name: str
    layer: Optional[int]
    storages: tuple
    host_bytes: int


def gpu_bytes(groups) -> int:
    """The bytes of the storages of ``groups``, each once."""
    return sum(dict(s for g in groups for s in g.storages).values())


def used(model) -> bool:
    return bool(getattr(model, "fine_grained_activation_offloading", False))


def findings(model) -> list[Finding]:
    """What of the offload the estimate does not model (Core's own refusals are in
    :mod:`megatron_bridge_ext.levers.activation_offload.constraints`)."""
    if not used(model):
        return []
    out = expert_offload.findings(model)
    if (getattr(model, "pipeline_model_parallel_size", 1) or 1) > 1 and \
            getattr(model, "delta_offload_bytes_across_pp_ranks", 0):
        out.append(Finding("unsupported_model", ERROR, "model.delta_offload_bytes_across_pp_ranks",
                           "is not modelled by the estimate: Core keeps pp_rank x that many bytes of whole groups on "
                           "the GPU, chosen over every microbatch's groups (fine_grained_activation_offload.py "
                           "L600-611)", "estimate with delta_offload_bytes_across_pp_ranks=0"))
    return out


class _Recorder:
    """Core's offload interface with our hooks: inside an offloading group, a tensor Core would offload goes to the
    group (not to the meter), any other to the hooks outside (the meter)."""

    def __init__(self, model: torch.nn.Module, min_size: int):
        self._stack = ModuleStack(model)
        self._min = min_size
        self._open: list = []
        self.groups: list = []

    def eligible(self, tensor: torch.Tensor) -> bool:
        """``tensor_need_offloading_checker`` (offload.py L986-1000) without its device check: every traced tensor
        stands for a GPU tensor."""
        return (not isinstance(tensor, torch.nn.Parameter) and tensor.numel() >= self._min
                and not getattr(tensor, "_do_not_offload", False) and not getattr(tensor, "_TE_do_not_offload", False))

    def enter(self, interface) -> torch.Tensor:
        if not interface.offload:
            return interface.tensor
        from megatron_bridge_ext.estimate.trace import layer_of

        storages: dict = {}
        host = [0]
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(tensor):
            if self.eligible(tensor):
                storage = tensor.untyped_storage()
                storages[(storage._cdata, str(storage.device))] = storage
                host[0] += tensor.numel() * tensor.element_size()
                return True, tensor if tensor.grad_fn is None and tensor.is_leaf else tensor.detach()
            return False, outer[0](tensor) if outer else tensor

        def unpack(packed):
            offloaded, value = packed
            return value if offloaded or not outer else outer[1](value)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._open.append((interface.name, layer_of(self._stack.current()), storages, hooks, host))
        return interface.tensor

    def exit(self, interface) -> None:
        if not interface.offload:
            return
        name, layer, storages, hooks, host = self._open.pop()
        hooks.__exit__(None, None, None)
        self.groups.append((name, layer, storages, host[0]))

    def result(self, counted) -> tuple[Group, ...]:
        """The groups, without the storages the meter ``counted(storage)`` (saved outside the groups too: they
        stay)."""
        return tuple(Group(name, layer, tuple(((layer, key), s.nbytes()) for key, s in storages.items()
                                              if not counted(s)), host)
                     for name, layer, storages, host in self.groups)


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[_Recorder]:
    """While ``model`` runs a microbatch under the saved-tensor meter: Core's offload interface (offload.py
    L1356-1470) with :class:`_Recorder`'s hooks, chunk handling a no-op (the trace has one chunk and no streams); the
    routed experts run as Core's TEGroupedMLP where it opens the experts' groups (:func:`.expert_offload.grouped`)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as Interface)

    config = model.config
    recorder = _Recorder(model, int(getattr(config, "min_offloaded_tensor_size", 1024 * 1024)))
    noop = staticmethod(lambda *args, **kwargs: None)
    with mock.patch.object(Interface, "__enter__", lambda self: recorder.enter(self)), \
            mock.patch.object(Interface, "__exit__", lambda self, *exc: recorder.exit(self)), \
            mock.patch.object(Interface, "group_offload", lambda self, tensor, *a, **k: tensor), \
            mock.patch.object(Interface, "init_chunk_handler", noop), \
            mock.patch.object(Interface, "mark_not_offload", staticmethod(_mark_not_offload)), \
            expert_offload.grouped(config):
        recorder._stack.install()
        try:
            yield recorder
        finally:
            recorder._stack.remove()


def _mark_not_offload(tensor) -> None:
    """Core's ``mark_not_offload`` (offload.py L772-777)."""
    if tensor is not None:
        tensor._do_not_offload = True


def kept(groups: tuple[Group, ...], fraction: float, *, first_backward: bool) -> tuple[Group, ...]:
    """The groups of one chunk that stay on the GPU after the warmup iteration (``post_warmup_callback``, offload.py
    L566-628): in the first chunk to run backward (``first_backward``) the last group of each name (L582-598); then
    of the groups still offloaded with bytes, the last ``int(n x (1 - fraction))`` (L612-628)."""
    stay = set()
    if first_backward:
        stay = {max(i for i, g in enumerate(groups) if g.name == name) for name in {g.name for g in groups}}
    eligible = [i for i, g in enumerate(groups) if i not in stay and g.host_bytes > 0]
    disabled = int(len(eligible) * (1 - fraction))
    stay |= set(eligible[len(eligible) - disabled:]) if disabled else set()
    return tuple(g for i, g in enumerate(groups) if i in stay)


def extended(groups: tuple[Group, ...], sources: list[int]) -> tuple[Group, ...]:
    """The groups of a reduced trace for the real stage, whose layer i is traced layer ``sources[i]`` (each layer's
    storages its own)."""
    outside = [g for g in groups if g.layer is None]
    inside = [Group(g.name, layer, tuple(((layer, key[1]), n) for key, n in g.storages), g.host_bytes)
              for layer, source in enumerate(sources) for g in groups if g.layer == source]
    return tuple(inside + outside)


KEPT = "activations the offload keeps on the GPU"
IN_FLIGHT_COPY = "offload copy in flight (one group)"


def components(groups: tuple[Group, ...], model, in_flight: float) -> list:
    """What the offload adds to the estimate of a stage whose trace left its groups out (:func:`recording`):

    * the groups the steady state keeps (:func:`kept`), in each of the ``in_flight`` microbatches (the average
      forwards held) and, once, the first backward chunk's last group of each name;
    * one group's storages as a transient: the group whose copy to the host has not finished (the side stream
      still uses the GPU tensor, ``record_stream``, offload.py L1016) or the group reloaded one ahead of its
      backward (``bulk_reload``, L1131-1146): assumed one group at a time, the copies keeping pace with the
      compute (an upper bound of one group when they do, an underestimate when copies queue up)."""
    if not groups:
        return []
    fraction = float(getattr(model, "activation_offload_fraction", 1.0))
    each = gpu_bytes(kept(groups, fraction, first_backward=False))
    first = gpu_bytes(kept(groups, fraction, first_backward=True))
    out = []
    if first:
        out.append(Component(ACTIVATIONS, KEPT, round(each * in_flight) + first - each,
                             f"measured: {each:,} B of offload groups kept per microbatch (the last "
                             f"int(n x (1 - {fraction:g})) of each chunk's n groups) x {in_flight:g} in flight, "
                             f"+ {first - each:,} B: the first backward chunk's last group of each name "
                             "(fine_grained_activation_offload.py L582-628)"))
    largest = max(gpu_bytes([g]) for g in groups)
    if largest:
        out.append(Component(TRANSIENT, IN_FLIGHT_COPY, largest,
                             f"measured: the largest offload group's {largest:,} B on the GPU while copied to the "
                             "host or reloaded one group ahead of its backward (fine_grained_activation_offload.py "
                             "L1002-1026, L1131-1146); one group at a time assumed"))
    return out


def host_bytes(groups: tuple[Group, ...], model) -> int:
    """The pinned host bytes of one microbatch's offloaded groups in the steady state (a chunk other than the first
    to run backward)."""
    stay = kept(groups, float(getattr(model, "activation_offload_fraction", 1.0)), first_backward=False)
    return sum(g.host_bytes for g in groups if g not in stay)


def assumption(groups: tuple[Group, ...], model, in_flight: float) -> Optional[str]:
    """The estimate's line on what the offload moved to pinned host memory, None without groups."""
    if not groups:
        return None
    fraction = float(getattr(model, "activation_offload_fraction", 1.0))
    stay = kept(groups, fraction, first_backward=False)
    host = host_bytes(groups, model)
    gone = gpu_bytes(groups) - gpu_bytes(stay)
    names = sorted({g.name for g in groups})
    return (f"fine-grained activation offloading of {', '.join(names)} (min_offloaded_tensor_size="
            f"{getattr(model, 'min_offloaded_tensor_size', 1024 * 1024):,} elements, activation_offload_fraction="
            f"{fraction:g}): {gone:,} B of each microbatch's saved activations leave the GPU, {host:,} B of pinned "
            f"host memory per microbatch x {in_flight:g} in flight (Core's offload summary counts each tensor); "
            "the warmup iteration offloads every group (fine_grained_activation_offload.py L1066-1087)")
