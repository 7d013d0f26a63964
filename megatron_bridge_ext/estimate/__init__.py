"""PEFT-aware per-rank memory estimate of a Bridge training config, measured from the real layer code.

``estimate(cfg)`` builds the model one rank of ``cfg`` would build, on fake tensors, counts its
parameters and runs one microbatch through it under the saved-activation meter: activations are
measured from Megatron Core's own layers with the config's parallel sizes, sequence parallelism,
PEFT and recompute settings, not taken from a fixed formula. The result, a
:class:`MemoryEstimate`, is a table of components, each with its bytes and what they rest on.

Modules: :mod:`.memory` (``estimate``), :mod:`.static` (weights, gradients, optimizer states),
:mod:`.trace` (one microbatch under the meter), :mod:`.build` (the rank's model),
:mod:`.fake` (the fake parallel world), :mod:`.standins` (fused-attention stand-in), :mod:`.routing`
(the stated MoE expert load), :mod:`.te`
(Transformer Engine's contract), :mod:`.bridge` (Bridge's own estimate, for comparison),
:mod:`.configs` (configs from a recipe or a Hugging Face config.json), :mod:`.device`
(estimate against a measured peak on a GPU), :mod:`.settings` (what an estimate was made for, read by attribute).
"""

from megatron_bridge_ext.estimate.report import Component, MemoryEstimate


def estimate(cfg, **options) -> MemoryEstimate:
    """See :func:`megatron_bridge_ext.estimate.memory.estimate`."""
    from megatron_bridge_ext.estimate.memory import estimate as run

    return run(cfg, **options)


__all__ = ["Component", "MemoryEstimate", "estimate"]
