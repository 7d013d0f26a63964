"""Muon's optimizer state, as Megatron Core 0.19 builds it (``optimizer.optimizer`` ``muon`` or ``dist_muon``).

Core builds Muon through ``_get_megatron_emerging_optimizer`` (``optimizer/__init__.py`` L725-985):

* which parameters Muon manages: a trainable parameter goes to the scalar optimizer (``muon_scalar_optimizer``,
  Adam by default) when it is the embedding or the output layer (``is_embedding_or_output_parameter``, set by
  ``language_module.py`` L224, L230) or is not two-dimensional (``emerging_optimizers.py`` L128-130,
  ``_is_nonlinear_or_embedding``, the ``muon`` entry's override L465-477; ``__init__.py`` L800-810); every other
  trainable parameter, experts' included, is a matrix Muon orthogonalizes (:func:`is_matrix`);
* its state: Emerging-Optimizers' ``OrthogonalizedOptimizer._init_group`` makes one ``momentum_buffer``,
  ``torch.zeros_like(p.data)`` (NVIDIA-NeMo/Emerging-Optimizers v0.4.0 (925e1bf),
  ``emerging_optimizers/orthogonalized_optimizers/orthogonalized_optimizer.py`` L127-145), and nothing else; with
  bf16 Core wraps the optimizer in ``Float16OptimizerWithFloat16Params`` (``__init__.py`` L894-897,
  ``layer_wise_optimizer.py`` L505-515), which hands it fp32 main copies (``optimizer.py`` L1012-1018), so a
  matrix costs 4 B of main copy + 4 B of momentum, and the scalar Adam's parameters 4 + 4 + 4 B;
* sharding: ``dist_muon`` (or ``use_layer_wise_distributed_optimizer``, ``__init__.py`` L742-754) wraps both in
  ``LayerWiseDistributedOptimizer``, which deals whole parameters out to the DP x CP ranks (the experts' to the
  expert-DP ranks), sorted by size in ping-pong order (``layer_wise_optimizer.py`` L632-681), and makes the main
  copies of its own share only (L502-517); plain ``muon`` shards nothing (``__init__.py`` L944-963).

The estimate divides the layer-wise state evenly over those ranks: ping-pong over sorted sizes leaves a rank at
most about one parameter above the mean. After the step the layer-wise optimizer all-gathers the updated
parameters (``allgather_params``, L736-787): one buffer per rank's share, the whole of the rank's dense trainable
parameters in their dtype, then the same for the experts (:func:`gather_transient`). Not counted: the step's
temporaries, made one parameter at a time: the Nesterov momentum, the normalised and iterated matrix and the scaled
result, fp32 copies of one matrix (Emerging-Optimizers v0.4.0 ``orthogonalized_optimizer.py`` L186-194,
``muon_utils.py`` L216-271), of the whole TP-gathered matrix with ``muon_tp_mode='duplicated'`` (L329-335).
"""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext.estimate.report import TRANSIENT, Component
from megatron_bridge_ext.findings import ERROR, Finding

NAMES = ("muon", "dist_muon")
MOMENTUM_BYTES = 4
"""``momentum_buffer``: ``zeros_like`` the fp32 main copy (or the fp32 parameter) Muon steps."""
ALL_GATHER = "layer-wise parameter all-gather (optimizer step)"


def is_muon(optimizer_config) -> bool:
    return getattr(optimizer_config, "optimizer", "adam") in NAMES


def layer_wise(optimizer_config) -> bool:
    """``dist_muon`` is ``muon`` with the layer-wise distributed optimizer (``__init__.py`` L744-754)."""
    return (getattr(optimizer_config, "optimizer", "") == "dist_muon"
            or bool(getattr(optimizer_config, "use_layer_wise_distributed_optimizer", False)))


def is_matrix(param) -> bool:
    """A parameter Muon itself steps: two-dimensional and neither the embedding nor the output layer."""
    return param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def findings(optimizer_config) -> list[Finding]:
    """The Muon set-ups whose state the estimate does not model, each refused in one line."""
    if not is_muon(optimizer_config):
        return []
    out = []
    scalar = getattr(optimizer_config, "muon_scalar_optimizer", "adam")
    if scalar != "adam":
        out.append(_refuse("optimizer.muon_scalar_optimizer",
                           f"Muon's scalar optimizer {scalar!r} is not modelled (its state differs from Adam's)",
                           "estimate with optimizer.muon_scalar_optimizer=adam"))
    if getattr(optimizer_config, "use_distributed_optimizer", False):
        out.append(_refuse("ddp.use_distributed_optimizer",
                           "Muon with the distributed optimizer is not modelled (Core then lays the buffers out "
                           "per shard for the layer-wise optimizer and shards the scalar Adam apart)",
                           "estimate with ddp.use_distributed_optimizer=false, as Bridge's Muon recipes set"))
    if getattr(optimizer_config, "optimizer_cpu_offload", False) or \
            getattr(optimizer_config, "use_precision_aware_optimizer", False):
        out.append(_refuse("optimizer.optimizer_cpu_offload",
                           "Muon with CPU offload or the precision-aware optimizer is not modelled (Core builds "
                           "both for Adam's distributed optimizer only)",
                           "estimate without optimizer_cpu_offload and use_precision_aware_optimizer"))
    if layer_wise(optimizer_config) and getattr(optimizer_config, "overlap_param_gather", False):
        out.append(_refuse("ddp.overlap_param_gather",
                           "the layer-wise optimizer's bucketed parameter all-gather (overlap_param_gather) is "
                           "not modelled", "estimate with ddp.overlap_param_gather=false"))
    return out


def _refuse(setting: str, message: str, fix: str) -> Finding:
    return Finding("unsupported_model", ERROR, setting, message, fix)


def gather_transient(optimizer_config, dense: int, experts: int, *, param_bytes: int, dense_shards: int,
                     expert_shards: int) -> Optional[Component]:
    """``allgather_params``' buffers (``layer_wise_optimizer.py`` L747-787): each of the group's ranks' shares of
    the parameters flattened in their dtype (the rank's own by ``_flatten_dense_tensors``, the others received
    into ``torch.empty``), so the whole of the rank's trainable dense parameters, freed before the experts' are
    gathered the same way over expert DP; none for a group of one rank (``shard_params`` L552-555, L679-681), nor
    without the layer-wise optimizer."""
    if not (is_muon(optimizer_config) and layer_wise(optimizer_config)):
        return None
    sizes = [n for n, shards in ((dense, dense_shards), (experts, expert_shards)) if shards > 1 and n]
    if not sizes:
        return None
    largest = max(sizes)
    return Component(TRANSIENT, ALL_GATHER, largest * param_bytes,
                     f"formula: {largest:,} parameters x {param_bytes} B: the layer-wise optimizer's all-gather "
                     "receives every rank's updated share of a group's parameters (dense over DP x CP, then "
                     "experts over expert DP), one group at a time (layer_wise_optimizer.py L747-787)")
