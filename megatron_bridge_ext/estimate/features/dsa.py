"""DeepSeek sparse attention (``experimental_attention_variant='dsa'``, GLM-5.2): Megatron Core's own layer, traced.

Core builds it from ``get_dsa_module_spec_for_backend`` (``models/gpt/experimental_attention_variant_module_specs.py``
L81-130): ``AbsorbedMLASelfAttention`` (``transformer/experimental_attention_variant/absorbed_mla.py``), whose core
attention is ``DSAttention`` with its ``DSAIndexer`` (``dsa.py``). The estimate builds that spec and runs Core's
code on fake tensors: the absorbed query (the key up projection folded into it, absorbed_mla.py L564-572), the
indexer's query, key and weights (dsa.py L1248-1322), its top-k (``fused_qk_topk_naive``), the indexer loss
(``FusedDSAIndexerLoss``, which keeps q, weights, k, the query, the key and the top-k indices, L944) and the sparse
attention. Top-k indices are data, but their shape is fixed ([b, s, index_topk]), so fake tensors carry them.
What it changes while tracing:

* The spec asks its backend for ``linear()`` (TE's ``TELinear``; Core's local backend has none) for the down
  projections and the indexer's three projections, all ``duplicated`` (absorbed_mla.py L282-283, L329-330;
  dsa.py L1158-1200): :class:`..mla.DuplicatedLinear` stands in, so the attention is always in Transformer Engine's
  layout. The query and key-value norms stay standalone, as the spec builds them (L107-111: the indexer reads the
  normalised query latent), Core's local norms.
* ``dsa_kernel_backend`` ``cudnn`` / ``tilelang``: Core's fused kernels (``dsa_cudnn_kernels.py``, FlashMLA and
  cuDNN graphs; ``dsa_tilelang_kernels.py``) need a GPU, and Core's config refuses them without CUDA
  (``utils.py`` L522-534). The estimate traces Core's PyTorch path in their place (``dsa_kernel_backend='none'``,
  Core's own fallback when a fused hook declines, dsa.py L144-167) and says so (:data:`KERNEL_NOTE`): it keeps the
  dense [b, heads/t, s, s] fp32 scores and probabilities (``_unfused_absorbed_dsa_fn``, L59-112) where FlashMLA's
  sparse kernel keeps the query, the latent key, its output and an fp32 log-sum-exp
  (``FusedSparseAttentionFunc``, dsa_cudnn_kernels.py L2547): an upper bound on what attention keeps.
* ``dsa_indexer_rotate_activation``: the Hadamard rotation is ``fast_hadamard_transform``'s CUDA kernel (dsa.py
  L253-269), which does not run here: refused (:func:`findings`); GLM-5.2's provider turns it off.

``dsv4_hybrid`` (DeepSeek-V4) is refused: the installed Megatron Core builds no such variant. Bridge's release
branch (``r0.6.0`` at 6124fbe, version 0.6.1, whose DeepSeek-V4 model, step and recipe files are 0.6.2's byte for
byte) pins its main Megatron-LM (``3rdparty/Megatron-LM`` at cd4afff, ``.main.commit``) without it and builds
DeepSeek-V4 on the dev branch it pins beside it (``.dev.commit`` 43e45e1, "bump mcore dev commit for DSv4 support"), whose Core
adds what the provider (``deepseek_v4_bridge.py`` L390-526) sets: the ``dsv4_hybrid`` spec
(``experimental_attention_variant_module_specs.py`` L147-201: ``DSv4HybridSelfAttention`` with
``CompressedSparseAttention``, its ``Compressor`` and ``CSAIndexer``, ``csa.py``), mHC hyper-connections over
``num_residual_streams`` residual streams (``transformer_config.py`` L1205-1217, ``hyper_connection.py``), hash
routing on the first ``moe_n_hash_layers`` MoE layers (``moe/router.py`` L200-207) and the ``o_groups`` /
``o_lora_rank`` grouped output projection (``transformer_config.py`` L3576-3579). No released megatron-core (the
newest is 0.19.2, whose ``core_r0.19.0`` branch lacks them all) carries them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from megatron_bridge_ext.findings import ERROR, Finding

DSA = "dsa"
FUSED_BACKENDS = ("cudnn", "tilelang")
KERNEL_NOTE = ("dsa_kernel_backend={backend}: Core's fused DeepSeek sparse attention kernels need a GPU; traced on "
               "Core's PyTorch path (dsa_kernel_backend='none', its fallback when a fused hook declines), whose "
               "absorbed sparse attention keeps the dense [b, heads/t, s, s] fp32 scores and probabilities "
               "(experimental_attention_variant/dsa.py L59-112) where FlashMLA's sparse kernel keeps the query, the "
               "latent key, its output and an fp32 log-sum-exp (dsa_cudnn_kernels.py L2547): attention's saved "
               "bytes are an upper bound")


def used(model) -> bool:
    return getattr(model, "experimental_attention_variant", None) == DSA


def findings(model) -> list[Finding]:
    """The experimental attention variants the estimate does not model, and the parts of DeepSeek sparse attention
    that cannot run here, one finding each."""
    variant = getattr(model, "experimental_attention_variant", None)
    if variant == "dsv4_hybrid":
        return [_not_modelled("model.experimental_attention_variant",
                              "DeepSeek-V4's 'dsv4_hybrid' attention is not modelled by the estimate: the installed "
                              "Megatron Core has no such variant (experimental_attention_variant_module_specs.py "
                              "L141-148 builds 'gated_delta_net' and 'dsa' only), nor mHC hyper-connections or hash "
                              "routing; Bridge builds the model on Megatron-LM's dev branch (its .dev.commit 43e45e1), "
                              "in no released megatron-core, so its model cannot be built here",
                              "read Bridge's figure beside it, or measure one training step on a GPU")]
    if variant and variant != DSA and getattr(model, "multi_latent_attention", False):  # others: .attention_variant
        return [_not_modelled("model.experimental_attention_variant",
                              f"the {variant!r} attention variant is not modelled by the estimate",
                              "read Bridge's figure beside it, or measure one training step on a GPU")]
    if used(model) and getattr(model, "dsa_indexer_rotate_activation", False):
        return [_not_modelled("model.dsa_indexer_rotate_activation",
                              "the DSA indexer's Hadamard rotation (fast_hadamard_transform, a CUDA kernel: "
                              "dsa.py L253-269) is not modelled by the estimate",
                              "estimate with model.dsa_indexer_rotate_activation=False (it keeps nothing for "
                              "backward beyond the indexer's query and key)")]
    return sharing_problems(model)


def index_shared(model) -> bool:
    """Whether layers reuse another layer's top-k (``dsa_indexer_topk_freq`` > 1, GLM-5.2's index sharing)."""
    return used(model) and (getattr(model, "dsa_indexer_topk_freq", 1) or 1) > 1


def source_of(model, layer: int) -> int:
    """The 0-based layer whose top-k 0-based ``layer`` uses: itself on a computing layer, else Core's source
    (``source_dsa_compute_layer``, dsa.py L50-56, on 1-based numbers)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import source_dsa_compute_layer

    if not index_shared(model):
        return layer
    return source_dsa_compute_layer(layer + 1, model.dsa_indexer_skip_topk_offset or 0, model.dsa_indexer_topk_freq) - 1


def sharing_problems(model) -> list[Finding]:
    """A model chunk whose skip layer's source does not run before it in the chunk: Core raises in that layer's
    forward (dsa.py L1962-1973: top-k is not shared across pipeline stages); one finding, the first such layer."""
    from megatron_bridge_ext.estimate import pipeline

    if not index_shared(model) or pipeline.split_problems(model):
        return []
    for stage, chunks in enumerate(pipeline.stage_chunks(model)):
        for chunk in chunks:
            for index, layer in enumerate(chunk.layers):
                if source_of(model, layer) not in chunk.layers[:index + 1]:
                    return [Finding("parallel_layout", ERROR, "model.dsa_indexer_topk_freq",
                                    f"layer {layer + 1} of pipeline stage {stage} reuses the top-k of layer "
                                    f"{source_of(model, layer) + 1}, which runs on another stage or model chunk: "
                                    "Megatron Core raises in its forward (dsa.py L1962-1973)",
                                    "split the pipeline so that each stage's model chunks start on a layer that "
                                    "computes its top-k")]
    return []


@contextlib.contextmanager
def real_layer_numbers(numbers: list[int]) -> Iterator[None]:
    """While a stage is built with its layers renumbered (its chunks as one, or a few of its layers): the
    ``DSAttention`` of the i-th layer number built takes the 0-based global number ``numbers[i]`` (+1, Core's
    1-based numbers), so that its computing or skipping the top-k and its source layer are the real layer's (dsa.py
    L1562-1575). Numbers past ``numbers`` (the MTP depths', numbered by Core on their own) are kept. A subclass's
    ``super().__init__`` comes through here again with the number already mapped: passed on as it is. Put back on
    exit."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    saved = DSAttention.__init__
    real: dict[int, int] = {}
    inside = []

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        if not inside:
            if layer_number not in real and len(real) < len(numbers):
                real[layer_number] = numbers[len(real)] + 1
            layer_number = real.get(layer_number, layer_number)
        inside.append(layer_number)
        try:
            saved(self, config, submodules, layer_number, *args, **kwargs)
        finally:
            inside.pop()

    DSAttention.__init__ = __init__
    try:
        yield
    finally:
        DSAttention.__init__ = saved


@contextlib.contextmanager
def indexer_loss_tracker() -> Iterator[None]:
    """While a stage is traced: a fresh tracker for Core's indexer-loss logging (``DSAIndexerLossLoggingHelper``, a
    class global sized by the first write's ``num_layers``, dsa.py L272-303), grown to the layer's number where the
    build keeps real numbers beyond its own layer count (:func:`real_layer_numbers`); the caller's back on exit. It
    logs one fp32 value per layer and keeps nothing for backward."""
    import torch
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper as helper

    saved_tracker, saved_save = helper.tracker, helper.__dict__["save_loss_to_tracker"]

    def save_loss_to_tracker(loss, layer_number, num_layers, *args, **kwargs):
        values = helper.tracker.get("values")
        if values is not None and layer_number is not None and layer_number > values.numel():
            helper.tracker["values"] = torch.cat([values, values.new_zeros(layer_number - values.numel())])
        size = num_layers if layer_number is None else max(num_layers, layer_number)
        return saved_save.__func__(loss, layer_number, size, *args, **kwargs)

    helper.tracker = {}
    helper.save_loss_to_tracker = staticmethod(save_loss_to_tracker)
    try:
        yield
    finally:
        helper.tracker = saved_tracker
        helper.save_loss_to_tracker = saved_save


@contextlib.contextmanager
def cp_lengths_by_shape() -> Iterator[None]:
    """While a stage is traced under context parallelism: Core's check that every CP rank holds as many tokens
    (``_validate_nonpacked_cp_uniform_length``, dsa.py L220-250: it all-gathers the lengths and compares their values,
    which fake tensors do not carry) compares the shapes only: the estimate gives every rank s / CP tokens. It keeps
    nothing for backward. Put back on exit."""
    from megatron.core.transformer.experimental_attention_variant import dsa as core_dsa

    saved = core_dsa._validate_nonpacked_cp_uniform_length

    def _validate_nonpacked_cp_uniform_length(sq, skv, cp_size, cp_group, device):
        if skv not in (sq, sq * cp_size):
            raise RuntimeError(f"DSA context parallelism: key length {skv} is neither {sq} nor {sq} x {cp_size}")

    core_dsa._validate_nonpacked_cp_uniform_length = _validate_nonpacked_cp_uniform_length
    try:
        yield
    finally:
        core_dsa._validate_nonpacked_cp_uniform_length = saved


def turn_off_fused_kernels(model) -> Optional[str]:
    """Trace Core's PyTorch path in place of a fused kernel backend (which needs CUDA, refused by Core's config
    check before anything is built) and say so; None where there is nothing to turn off."""
    backend = getattr(model, "dsa_kernel_backend", "none")
    if not used(model) or backend not in FUSED_BACKENDS:
        return None
    model.dsa_kernel_backend = "none"
    return KERNEL_NOTE.format(backend=backend)


def _backend():
    """Core's local backend with :class:`..mla.DuplicatedLinear` for the ``linear()`` the DSA spec asks for."""
    from megatron.core.models.backends import LocalSpecProvider

    from megatron_bridge_ext.estimate.features.mla import DuplicatedLinear

    class _DuplicatedLinearBackend(LocalSpecProvider):
        def linear(self) -> type:
            return DuplicatedLinear

    return _DuplicatedLinearBackend()


def attention_spec(config):
    """Core's DSA self-attention spec for ``config`` (``get_dsa_module_spec_for_backend``), its ``duplicated``
    linears by :class:`..mla.DuplicatedLinear`."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend

    return get_dsa_module_spec_for_backend(config, backend=_backend())


@contextlib.contextmanager
def te_modules() -> Iterator[None]:
    """While the model is built: Core's absorbed MLA layer takes :class:`..mla.DuplicatedLinear` for ``TELinear``,
    so that it asks its down projections for the ``duplicated`` mode (absorbed_mla.py L282-283, L329-330; without
    Transformer Engine Core's name is None and it refuses the linear). Put back on exit."""
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    from megatron_bridge_ext.estimate.features.mla import DuplicatedLinear

    saved = absorbed_mla.TELinear
    absorbed_mla.TELinear = DuplicatedLinear
    try:
        yield
    finally:
        absorbed_mla.TELinear = saved


def assumption(model) -> Optional[str]:
    """How the estimate traced the model's sparse attention, or None without it."""
    if not used(model):
        return None
    return ("DeepSeek sparse attention: Megatron Core's AbsorbedMLASelfAttention and DSAttention traced, its "
            "indexer, top-k and indexer loss on Core's PyTorch path; down projections and the indexer's projections "
            "duplicated on every TP rank (a stand-in for TELinear's) (estimate.features.dsa)")


def _not_modelled(setting: str, message: str, fix: str) -> Finding:
    return Finding("unsupported_model", ERROR, setting, message, fix)
