"""What fine-grained activation offloading costs in step time: its host-device copies over the host link.

Core copies each group to pinned host memory on a side stream right after the group's forward
(``pipeline_parallel/fine_grained_activation_offload.py`` L1002-1026, ``d2h_stream``) and back on another one group
ahead of its backward (L1131-1146, ``h2d_stream``), so the copies run under the other layers' compute. The step-time
model charges them as it charges CPU offloading (:func:`megatron_bridge_ext.levers.steptime.step_time`,
``offload_bytes``): both directions at the GPU preset's per-direction host-link rate (``Gpu.pcie``: PCIe Gen5 x16
for H100/H200/B200/B300, NVLink-C2C for GB200/GB300), what exceeds the step's compute exposed, and at least one
layer's share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.settings import Settings

ATTENTION = ("qkv_linear", "core_attn", "attn_proj")
"""The offload the search tries: the attention's inputs (with Transformer Engine's layer spec the norms are fused into
the linears, so ``attn_norm``/``mlp_norm`` offload nothing: transformer_layer.py L1442-1450)."""


EXPERTS = ("expert_fc1", "moe_act")
"""The routed experts' groups the search tries on an MoE model whose experts open them
(:func:`..estimate.features.expert_offload.groups_open`): fc1's whole input and what the activation saves."""


def step_bytes(host_bytes_per_microbatch: int, num_microbatches: int) -> int:
    """Bytes over the host link in a step: each microbatch's offloaded bytes to the host and back."""
    return 2 * host_bytes_per_microbatch * num_microbatches


def predicted_host_bytes(s: "Settings", modules: tuple) -> int:
    """The host bytes per microbatch of offloading ``modules`` (of :data:`ATTENTION` and :data:`EXPERTS`), from the
    shapes, to rank a candidate before its estimate (which then traces the exact figure): per layer the input of
    ``linear_qkv`` [s, b, h]
    (its sequence shard under SP), the core attention's q [s, b, heads x d], k and v [s, b, groups x d] and output
    [s, b, heads x d] per TP rank, and that output again for ``attn_proj`` (Core copies each group's tensors, a shared
    one in each group: L394-397)."""
    tokens = s.seq_length // s.cp * s.micro_batch
    heads, groups = s.heads * s.kv_channels // s.tp, s.query_groups * s.kv_channels // s.tp
    per_layer = {"qkv_linear": tokens * s.hidden // (s.tp if s.sequence_parallel else 1),
                 "core_attn": tokens * (2 * heads + 2 * groups), "attn_proj": tokens * heads}
    from megatron_bridge_ext.levers.steptime import element_size

    attention = sum(per_layer[m] for m in modules if m in per_layer) * s.layers_on_stage
    return (attention + _experts_per_microbatch(s, modules)) * element_size(s)


def _experts_per_microbatch(s: "Settings", modules: tuple) -> int:
    """The elements the experts' groups of ``modules`` offload per microbatch, from the shapes (balanced routing):
    per MoE layer fc1's input [routed, h] and the fused activation's input [routed, 2 x ffn / ETP], ``routed`` the
    rank's tokens (its sequence shard under SP) x top-k x ETP (the expert-TP group gathers them)."""
    moe = s.moe
    if moe is None or not set(modules) & set(EXPERTS):
        return 0
    tokens = s.seq_length // s.cp * s.micro_batch // (s.tp if s.sequence_parallel else 1)
    routed = tokens * moe.topk * moe.etp
    per_layer = {"expert_fc1": routed * s.hidden, "moe_act": routed * 2 * (moe.ffn or s.ffn) // moe.etp}
    return sum(per_layer[m] for m in modules if m in per_layer) * moe.layers_on_stage
