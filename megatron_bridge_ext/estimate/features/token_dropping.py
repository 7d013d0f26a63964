"""Token dropping (expert capacity): each expert takes at most ``capacity`` tokens from each rank's router.

Core caps every expert's tokens from one router at ``capacity = ceil(tokens x top-k / experts x factor)``
(``moe_utils.py`` ``get_capacity`` L241-259, ``apply_router_token_dropping`` L958-1021, called by the router,
``router.py`` L788-796), and with ``moe_pad_expert_input_to_capacity`` pads each expert to exactly the capacity.
Core's drop code runs on the fake tensors as it is (top-k, scatter, the masked probabilities); the counts the
dispatchers read from the capped map are stated by :meth:`..routing.RoutedLoad.received` (the stated share capped
at the capacity, or the capacity when padded). The all-to-all dispatcher padded to capacity is Core's own static
path (``token_dispatcher.py`` L511-531), and so is HybridEP's (L1105-1119: Core sizes the dispatch by the capacity,
which the kernel stand-in takes; its counts, which Core makes on the device, are handed to the experts on the host:
:func:`padded_counts_on_host`). DeepEP, and HybridEP without padding, size their dispatch from the capped map
through the kernels' own counts, which the stand-ins state dropless: refused there."""

from __future__ import annotations

import contextlib
from typing import Iterator

from megatron_bridge_ext.estimate.features import hybridep
from megatron_bridge_ext.findings import ERROR, Finding


def used(model) -> bool:
    return bool(getattr(model, "num_moe_experts", None)) and (
        getattr(model, "moe_expert_capacity_factor", None) is not None
        or bool(getattr(model, "moe_pad_expert_input_to_capacity", False)))


def findings(model) -> list[Finding]:
    if not used(model) or getattr(model, "moe_token_dispatcher_type", "allgather") != "flex":
        return []
    padded = bool(getattr(model, "moe_pad_expert_input_to_capacity", False))
    if getattr(model, "moe_flex_dispatcher_backend", None) == hybridep.HYBRIDEP and padded:
        return []
    return [Finding("unsupported_model", ERROR, "model.moe_expert_capacity_factor",
                    "token dropping on the flex dispatcher is not modelled by the estimate unless HybridEP pads to "
                    "capacity (its kernels count the capped tokens, which the stand-ins state dropless)",
                    "estimate with model.moe_pad_expert_input_to_capacity=true on HybridEP, or on Core's all-to-all "
                    "dispatcher (model.moe_token_dispatcher_type=alltoall)")]


def assumption(model):
    """How the estimate traced the experts' capacity, or None without token dropping."""
    if not used(model):
        return None
    how = "padded to exactly the capacity" if model.moe_pad_expert_input_to_capacity else "capped at the capacity"
    return (f"token dropping: each expert's tokens from each router {how}, ceil(tokens x top-k / experts x "
            f"{model.moe_expert_capacity_factor:g}) (Core's get_capacity; estimate.features.token_dropping)")


@contextlib.contextmanager
def padded_counts_on_host(model) -> Iterator[None]:
    """While HybridEP padded to capacity is traced: Core's ``_HybridEPManager.setup_metadata`` (L1105-1119) makes
    the experts' counts, the capacity from every rank, with ``torch.full`` on the device, which the experts read
    back (``tolist``) and which on fake tensors is a size no one knows; the same counts are handed over as a host
    tensor, as the dispatcher's other counts are (:mod:`..routing`). Nothing without HybridEP padded to capacity."""
    if not (used(model) and hybridep.used(model) and model.moe_pad_expert_input_to_capacity):
        yield
        return
    from megatron.core.transformer.moe import token_dispatcher as td

    from megatron_bridge_ext.estimate.routing import _host_tensor

    manager = td._HybridEPManager
    core = manager.__dict__["setup_metadata"]

    def setup_metadata(self, routing_map, probs):
        core(self, routing_map, probs)
        self.tokens_per_expert = _host_tensor([self.capacity * self.group.size()] * self.num_local_experts)

    manager.setup_metadata = setup_metadata
    try:
        yield
    finally:
        manager.setup_metadata = core
