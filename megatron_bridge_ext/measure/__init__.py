"""Measure what a training step keeps in memory and what tensor parallelism sends over the wire.

Context managers, each attributing its observations to the innermost named module whose forward
is running (through global module forward hooks, shared in :class:`ModuleStack`):

* :class:`SavedActivationMeter` (:mod:`.saved`) counts the bytes autograd retains for backward
  during forward passes: the tensors packed into the graph through
  ``torch.autograd.graph.saved_tensors_hooks``. This is the activation memory that peak-memory
  work (sequence-parallel LoRA input, selective recompute) shrinks, measured independently of
  allocator caching and of the device.
* :class:`CollectiveCounter` (:mod:`.collectives`) records every ``torch.distributed`` collective
  issued, including the aliases Megatron Core binds at import (``dist_all_gather_func``, ...), with
  its size, phase (forward/backward) and module, so that a change in communication volume shows
  up as a number rather than as a profile to read.

They are measurement tools: enter them around the steps to measure, not around production runs.
"""

from megatron_bridge_ext.measure.collectives import CollectiveCall, CollectiveCounter
from megatron_bridge_ext.measure.modules import ROOT, ModuleStack, module_names
from megatron_bridge_ext.measure.saved import SavedActivationMeter, SavedActivations, default_category

__all__ = [
    "ROOT", "CollectiveCall", "CollectiveCounter", "ModuleStack", "SavedActivationMeter",
    "SavedActivations", "default_category", "module_names",
]
