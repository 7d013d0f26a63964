"""Latent MoE (``moe_latent_size``, Nemotron 3 Super and Ultra): the routed experts work in a smaller latent space.

Core's ``MoELayer`` (``transformer/moe/moe_layer.py``) projects the layer input down to ``moe_latent_size`` before
the token dispatcher (``fc1_latent_proj``, L265-297, applied in ``preprocess`` L481-483) and the combined expert
output back up to the hidden size after it (``fc2_latent_proj``, L584-585); the dispatcher moves latent tokens and
the routed experts take and return ``moe_latent_size`` (``experts.py``
L218-241, ``mlp.py`` L218-245); the router and the shared experts keep the hidden size. Both projections are
Transformer Engine's ``TELinear`` in ``duplicated`` mode (the whole weight on every TP rank, the rank's sequence
shard in, no communication), which Core asserts TE for (L266): the estimate traces Core's layer with
:class:`..mla.DuplicatedLinear` in their place (the stand-in multi-latent attention's down projections use, with
TE's saved set), so that the dispatcher, the experts and their saves are Core's own at the latent width.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from megatron_bridge_ext.findings import ERROR, Finding


def used(model) -> bool:
    return bool(getattr(model, "num_moe_experts", None) and getattr(model, "moe_latent_size", None))


def findings(model) -> list[Finding]:
    """The variant the estimate does not model: biases on the projections (the stand-in has none)."""
    if not used(model) or not getattr(model, "add_bias_linear", False):
        return []
    return [Finding("unsupported_model", ERROR, "model.add_bias_linear",
                    "biases on latent MoE's projections are not modelled by the estimate",
                    "estimate with model.add_bias_linear=False")]


def config_problems(model) -> list[Finding]:
    """What Core refuses to train with latent projections: shared experts overlapped with the dispatcher
    (``moe_layer.py`` L469-475 raises in the first forward), refused before anything is built."""
    if not (used(model) and getattr(model, "moe_shared_expert_overlap", False)):
        return []
    return [Finding("model_config", ERROR, "model.moe_shared_expert_overlap",
                    "is on with latent MoE projections, which Megatron Core refuses in training (moe_layer.py "
                    "L469-475)", "set model.moe_shared_expert_overlap=False")]


@contextlib.contextmanager
def te_modules(model) -> Iterator[None]:
    """While ``model``'s layers are built: Core's MoE layer takes :class:`..mla.DuplicatedLinear` for ``TELinear``
    and finds Transformer Engine (``moe_layer.py`` L61-64, L266); put back on exit. Nothing without latent MoE."""
    if not used(model):
        yield
        return
    from megatron.core.transformer.moe import moe_layer

    from megatron_bridge_ext.estimate.features.mla import DuplicatedLinear

    saved = moe_layer.HAVE_TE, moe_layer.TELinear
    moe_layer.HAVE_TE, moe_layer.TELinear = True, DuplicatedLinear
    try:
        yield
    finally:
        moe_layer.HAVE_TE, moe_layer.TELinear = saved


def assumption(model) -> Optional[str]:
    if not used(model):
        return None
    return (f"latent MoE: Megatron Core's MoE layer traced with its latent projections (h {model.hidden_size} -> "
            f"{model.moe_latent_size} before the dispatcher and back after the combine; Transformer Engine's "
            "duplicated TELinear by a stand-in with its saved set), the dispatcher and the routed experts at the "
            "latent width (estimate.features.latent_moe)")
