"""What a parallel layout or CPU offloading cannot be combined with, checked before launch."""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding

MAX_TP = 8
"""Largest TP the planner proposes: one NVLink node (8 GPUs); beyond it TP traffic leaves NVLink."""


def model_findings(model, granularity: Optional[str]) -> list[Finding]:
    """Megatron Core's refusals on offloading, CUDA graphs and saved activations, given the recompute
    granularity the model will have (:meth:`megatron_bridge_ext.levers.recompute.config.RecomputeConfig.granularity`)."""
    out = []
    if getattr(model, "cpu_offloading", False):
        if granularity is not None:
            out.append(Finding("offload_with_recompute", ERROR, "model.cpu_offloading",
                               "CPU offloading cannot be combined with activation recompute",
                               "turn off model.cpu_offloading or the recompute flags"))
        if getattr(model, "pipeline_model_parallel_size", 1) > 1:
            out.append(Finding("offload_with_pp", ERROR, "model.cpu_offloading",
                               "CPU offloading needs pipeline parallel size 1",
                               "set model.pipeline_model_parallel_size=1 or turn off model.cpu_offloading"))
    graphs = getattr(model, "cuda_graph_impl", "none") or "none"
    if granularity == "full" and graphs not in ("none", "full_iteration"):
        out.append(Finding("full_recompute_cuda_graphs", ERROR, "model.recompute_granularity",
                           f"full recompute with per-layer CUDA graphs ({graphs})",
                           "use cuda_graph_impl='full_iteration' or selective recompute"))
    if getattr(model, "distribute_saved_activations", False) and getattr(model, "sequence_parallel", False):
        out.append(Finding("distribute_saved_activations_sp", ERROR, "model.distribute_saved_activations",
                           "cannot be combined with sequence parallelism",
                           "set model.distribute_saved_activations=False"))
    return out


def doubling_findings(name: str, old: int, dp: int) -> list[Finding]:
    """Why ``name`` (``"PP"`` or ``"TP"``) cannot go from ``old`` to ``2 * old`` on the same GPUs (DP halves)."""
    problems = []
    if dp % 2:
        problems.append(Finding("needs_gpus", ERROR, "data parallel size", f"DP={dp} cannot be halved: "
                                f"{name} x 2 needs twice the GPUs", "add GPUs, or choose another lever"))
    if name == "TP" and 2 * old > MAX_TP:
        problems.append(Finding("tp_beyond_node", ERROR, "model.tensor_model_parallel_size",
                                f"TP={2 * old} spans more than one {MAX_TP}-GPU NVLink node",
                                f"keep TP <= {MAX_TP}"))
    return problems
