"""The MoE paged stash (Megatron Core 0.19 ``moe_paged_stash``, ``transformer/moe/paged_stash.py``): refused by name.

Core's stash takes over the saved tensors that Transformer Engine's grouped expert GEMMs mark
(``on_save_for_backward`` keeps only tensors with ``grouped_tensor_scale_inv``, L679-691, an attribute Core never sets)
into per-(dtype, hidden) page buffers. Their size is read off a run: the first training iteration records the tokens
each expert rank received per layer and microbatch (``status == 'capture'``, L697-740), and the second allocates
``max tokens x |moe_paged_stash_buffer_size_factor_cuda|`` rows of the GPU buffer (and optionally pinned host rows,
``..._cpu``) from those counts (``paged_stash_reset``, L889-915; ``allocate_stash_buffers``, L546-627). The counts
come from the routing of real data through TE kernels, neither of which the fake trace has.
"""

from __future__ import annotations

from megatron_bridge_ext.findings import ERROR, Finding


def findings(model) -> list[Finding]:
    """One finding when ``model.moe_paged_stash`` is on."""
    if not getattr(model, "moe_paged_stash", False):
        return []
    return [Finding("unsupported_model", ERROR, "model.moe_paged_stash",
                    "the MoE paged stash is not modelled by the estimate: its buffers are sized from the tokens each "
                    "expert rank received in a recorded iteration (moe/paged_stash.py L546-627, L697-740), through "
                    "Transformer Engine's grouped GEMMs",
                    "estimate with moe_paged_stash=False and moe_expert_rank_capacity_factor unset, then add the "
                    "stash's buffer (expert tokens x hidden x moe_paged_stash_buffer_size_factor_cuda)")]
