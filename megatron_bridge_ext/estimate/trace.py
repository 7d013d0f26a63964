"""One microbatch through a rank's model on fake tensors, counting what autograd keeps for backward.

The count is :class:`megatron_bridge_ext.measure.SavedActivationMeter`'s, the same meter the tests
and ``mbx bench memory`` read on real runs, with a classifier that sorts the modules into the
estimate's categories. Each storage counts once, in the category of the first module that saved it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bridge_ext.estimate.features import activation_offload
from megatron_bridge_ext.estimate.precision import LINEARS, MAMBA_LINEARS
from megatron_bridge_ext.measure import ROOT, SavedActivationMeter

NORMS = "norms"
ATTENTION = "attention"
MAMBA = "mamba"
MLP = "mlp"
MOE_DISPATCH = "moe dispatch"
EXPERTS = "experts"
LORA_INPUTS = "lora inputs"
EMBEDDING = "embedding"
LOGITS_LOSS = "logits and loss"
CHECKPOINT_INPUTS = "recompute checkpoints"
MTP = "multi-token prediction"
CATEGORIES = (EMBEDDING, NORMS, ATTENTION, MAMBA, MLP, MOE_DISPATCH, EXPERTS, LORA_INPUTS, CHECKPOINT_INPUTS, MTP,
              LOGITS_LOSS)


HYBRID_NORMS = ("norm", "final_norm", "post_per_layer_input_norm")
"""The norms named otherwise than GPT's ``*layernorm``: a Mamba layer's input norm (``decoder.layers.N.norm``), the
hybrid stack's final norm (``decoder.final_norm``) and the norm of a Gemma 4 layer's per-layer input block."""
PER_LAYER_EMBEDDING = ("per_layer_embedding", "per_layer_model_proj", "per_layer_proj_norm", "per_layer_input_gate",
                       "per_layer_projection")
"""Gemma 4's per-layer embedding (Bridge ``models/gemma/modeling_gemma4.py``): the model's table, the projection of the
embedding's output and its norm (``_attach_ple_modules``, L884-915), which make each layer's input slice before the
decoder (``_compute_per_layer_inputs``, L918-956), and in each layer the gate and projection that add that slice to
the hidden states (``Gemma4DenseTransformerLayer``, L558-568 and L587-602)."""


def category_of(module: str, moe_layers: frozenset = frozenset()) -> str:
    """The estimate's category of a module of a Megatron Core GPTModel or HybridModel, by its qualified name.

    Adapters (``...adapter...``) are LoRA inputs wherever they sit; what multi-token prediction's block
    (``mtp...``: its norms, ``eh_proj`` and transformer layers) saves is its own category; a hybrid model's Mamba mixer
    (``...mixer...``: its projections, scan and gated norm) is mamba; norms (``*layernorm``) before
    attention and MLP so that q/k norms count as norms; the rotary embedding's cos/sin count with
    attention; Gemma 4's per-layer embedding (:data:`PER_LAYER_EMBEDDING`, before the decoder and in each layer) is
    embedding. In a mixture-of-experts layer (``moe_layers``: the names of its MoE modules), the routed
    experts are experts, the router and what the MoE module saves itself (the token dispatcher is no
    module: permutation indices, gathered or all-to-all'd tokens and probabilities) are moe dispatch, latent MoE's
    projections around the routed experts (``fc1_latent_proj``, ``fc2_latent_proj``) count with the experts, and
    shared experts are mlp. Saves made by the decoder itself (outside every layer) are the inputs that full
    recompute checkpoints keep; the model's own forward (``<root>``: the logits cast and the loss)
    and the output layer are logits and loss.
    """
    parts = module.split(".")
    if "adapter" in parts:
        return LORA_INPUTS
    if parts[0] == "mtp":
        return MTP
    if "mixer" in parts:
        return MAMBA
    if any(part.endswith("layernorm") for part in parts) or parts[-1] in HYBRID_NORMS:
        return NORMS
    if "self_attention" in parts or "rotary_pos_emb" in parts:
        return ATTENTION
    if parts[-1] in PER_LAYER_EMBEDDING:
        return EMBEDDING
    owner = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in moe_layers), None)
    if owner is not None:
        below = parts[len(owner.split(".")):]
        if below[:1] in (["experts"], ["fc1_latent_proj"], ["fc2_latent_proj"]):
            return EXPERTS
        if not below or below[:1] == ["router"]:
            return MOE_DISPATCH
    if "mlp" in parts:
        return MLP
    if parts[0] == "embedding":
        return EMBEDDING
    if parts[0] == "decoder":
        return CHECKPOINT_INPUTS
    if module == ROOT or parts[0] == "output_layer":
        return LOGITS_LOSS
    raise ValueError(f"module {module!r} has no estimate category")


def layer_of(module: str) -> Optional[int]:
    """The index of the transformer layer (``decoder.layers.N``) a module belongs to, if any."""
    parts = module.split(".")
    if parts[:2] == ["decoder", "layers"] and len(parts) > 2 and parts[2].isdigit():
        return int(parts[2])
    return None


def classifier(moe_layers: frozenset = frozenset()):
    """A classifier for the meter: ``category|layer`` (layer empty outside the layers); see :func:`split`."""

    def category_and_layer(module: str) -> str:
        layer = layer_of(module)
        return f"{category_of(module, moe_layers)}|{'' if layer is None else layer}"

    return category_and_layer


def moe_layers_of(model: torch.nn.Module) -> frozenset:
    """The qualified names of the model's MoE modules (Megatron Core's ``BaseMoELayer``)."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    return frozenset(name for name, module in model.named_modules() if isinstance(module, BaseMoELayer))


def split(result) -> tuple[dict[str, int], dict[int, int]]:
    """Bytes per category and per layer from a meter result classified by :func:`classifier`."""
    by_category = dict.fromkeys(CATEGORIES, 0)
    by_layer: dict[int, int] = {}
    for (category, layer), nbytes in split_by_category_and_layer(result).items():
        by_category[category] += nbytes
        if layer is not None:
            by_layer[layer] = by_layer.get(layer, 0) + nbytes
    return by_category, by_layer


def split_by_category_and_layer(result) -> dict[tuple[str, Optional[int]], int]:
    """Bytes per (category, layer or None) from a meter result classified by :func:`classifier`."""
    out: dict[tuple[str, Optional[int]], int] = {}
    for key, nbytes in result.by_category.items():
        category, layer = key.split("|")
        index = (category, int(layer) if layer else None)
        out[index] = out.get(index, 0) + nbytes
    return out


@dataclass(frozen=True)
class TracedMicrobatch:
    """What one microbatch saved on this rank, and the buffers the forward left allocated.

    Each storage counts once, for the first module that saved it: ``by_category`` and ``by_layer``
    (the bytes first saved inside each transformer layer) split the same ``saved_bytes``.
    """

    saved_bytes: int
    by_category: dict[str, int]
    by_layer: dict[int, int]
    persistent_buffer_bytes: int
    lora_a_saved: dict[str, int]
    """What each LoRA-A saved, per module (for the TE contract): ``...adapter.linear_in``, and CanonicalLoRA's
    ``...adapter.adapter_q.linear_in`` (one per split adapter)."""
    by_category_and_layer: dict[tuple[str, Optional[int]], int] = dataclasses.field(default_factory=dict)
    linear_saved: dict[str, int] = dataclasses.field(default_factory=dict)
    """What each dense linear of a layer saved (:func:`is_dense_linear`), per module, shared or not (for the FP8
    contract, :mod:`.te_fp8`)."""
    linear_alone: dict[str, int] = dataclasses.field(default_factory=dict)
    """The part of ``linear_saved`` in storages no other module saved: what goes when TE keeps that input
    quantised instead."""
    offload_groups: tuple = ()
    """The fine-grained activation offload's groups, in forward order (:mod:`.features.activation_offload`): their
    offloaded storages are in no figure above."""

    def extended(self, sources: list[int]) -> "TracedMicrobatch":
        """This trace of a reduced stage as the real stage, whose layer i saves what traced layer ``sources[i]`` did.

        For a stage whose layers after the first save what a traced layer of the same kind (dense or MoE) saves
        (:func:`..memory.traced_layers`; the first differs only where the embedding's output feeds it).
        """
        per = dict(self.by_category_and_layer)
        outside = {key: nbytes for key, nbytes in per.items() if key[1] is None}
        layered = {(category, layer): per.get((category, source), 0)
                   for layer, source in enumerate(sources) for category in CATEGORIES}
        by_category_and_layer = {**outside, **{key: nbytes for key, nbytes in layered.items() if nbytes}}
        by_category = dict.fromkeys(CATEGORIES, 0)
        for (category, _), nbytes in by_category_and_layer.items():
            by_category[category] += nbytes
        by_layer = {layer: self.by_layer.get(source, 0) for layer, source in enumerate(sources)}
        saved = self.saved_bytes - sum(self.by_layer.values()) + sum(by_layer.values())
        return dataclasses.replace(self, saved_bytes=saved, by_category=by_category, by_layer=by_layer,
                                   lora_a_saved=_from_sources(self.lora_a_saved, sources),
                                   linear_saved=_from_sources(self.linear_saved, sources),
                                   linear_alone=_from_sources(self.linear_alone, sources),
                                   by_category_and_layer=by_category_and_layer,
                                   offload_groups=activation_offload.extended(self.offload_groups, sources))


def _from_sources(per_module: dict[str, int], sources: list[int]) -> dict[str, int]:
    """``per_module`` (keyed by module name) for the real stage: layer i's modules are traced layer ``sources[i]``'s;
    modules outside the layers are kept."""
    out = {name: nbytes for name, nbytes in per_module.items() if layer_of(name) is None}
    for layer, source in enumerate(sources):
        prefix = f"decoder.layers.{source}."
        out.update({f"decoder.layers.{layer}.{name[len(prefix):]}": nbytes
                    for name, nbytes in per_module.items() if name.startswith(prefix)})
    return out


def is_dense_linear(module: str) -> bool:
    """A dense linear of a transformer layer (``decoder.layers.N.mlp.linear_fc1``) or of a hybrid model's Mamba mixer
    (``decoder.layers.N.mixer.in_proj``), or the base linear a PEFT wraps in it (``...linear_fc1.to_wrap``)."""
    parts = module.split(".")
    if layer_of(module) is None:
        return False
    path = ".".join(parts[3:-1] if parts[-1] == "to_wrap" else parts[3:])
    return path in LINEARS + MAMBA_LINEARS


CHUNK_FORWARD_FILES = ("megatron/core/recompute.py", "megatron/core/transformer/transformer_block.py")
"""Where Core defines the function each full-recompute chunk checkpoints: ``custom_forward`` of ``custom(start, end)``
(Core 0.19 ``recompute.py`` L58-121, ``chunk_runner`` L125-144; Core 0.18 in ``transformer_block.py``)."""


def chunk_start(function) -> Optional[int]:
    """The first layer of the full-recompute chunk ``function`` runs (the ``start`` its closure holds), None for any
    other checkpointed function (selective recompute's, multi-token prediction's)."""
    code = getattr(function, "__code__", None)
    if code is None or code.co_name != "custom_forward" or "start" not in code.co_freevars:
        return None
    if not code.co_filename.replace("\\", "/").endswith(CHUNK_FORWARD_FILES):
        return None
    return function.__closure__[code.co_freevars.index("start")].cell_contents


@contextlib.contextmanager
def checkpoints_by_layer(meter: SavedActivationMeter):
    """Full recompute's checkpoint of each chunk counted as its first layer's (``decoder.layers.N``, category
    :data:`CHECKPOINT_INPUTS`), not the decoder's: Core checkpoints a chunk's inputs from the decoder's own forward
    through ``tensor_parallel.checkpoint`` (or ``te_checkpoint`` under FP8), outside every layer. So a stage traced
    with a few layers extends to the real stage layer by layer (:meth:`TracedMicrobatch.extended`), and each
    checkpoint is alive as long as its layer's chunk (:meth:`..pipeline.InFlight.weight`)."""
    from unittest import mock

    from megatron.core import tensor_parallel

    def attributed(real):
        def checkpoint(function, *args, **kwargs):
            start = chunk_start(function)
            if start is None:
                return real(function, *args, **kwargs)
            with meter.acting_as(f"decoder.layers.{start}"):
                return real(function, *args, **kwargs)
        return checkpoint

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(tensor_parallel, "checkpoint", attributed(tensor_parallel.checkpoint)))
        for module in _chunk_runner_modules():
            if getattr(module, "te_checkpoint", None) is not None:
                stack.enter_context(mock.patch.object(module, "te_checkpoint", attributed(module.te_checkpoint)))
        yield


def _chunk_runner_modules() -> list:
    import importlib

    out = []
    for name in ("megatron.core.recompute", "megatron.core.transformer.transformer_block"):
        try:
            out.append(importlib.import_module(name))
        except ImportError:  # Core before 0.19 has no recompute module
            pass
    return out


def trace_microbatch(model: torch.nn.Module, mode, *, seq: int, micro_batch: int, hidden: int, dtype: torch.dtype,
                     device: str, sequence_parallel_tp: int) -> TracedMicrobatch:
    """Run one forward of ``model`` (a GPTModel of one pipeline stage) on fake tensors under the meter.

    The first stage takes token ids; later stages take the previous stage's output [s/t, b, h]
    (sequence shard under SP), as the pipeline schedule hands it over, requiring grad. The last
    stage computes the loss from labels. With fine-grained activation offloading what Core offloads leaves the
    count (:func:`.features.activation_offload.recording`).
    """
    from megatron.core import parallel_state

    with mode:
        ids = torch.zeros(micro_batch, seq, dtype=torch.long, device=device)
        positions = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch, -1)
        labels = ids if model.post_process else None
        if not model.pre_process:
            received = torch.empty(seq // sequence_parallel_tp, micro_batch, hidden, dtype=dtype, device=device,
                                   requires_grad=True)
            model.set_input_tensor(received)
        offload = activation_offload.used(model.config)
        full = getattr(model.config, "recompute_granularity", None) == "full"
        with SavedActivationMeter(model, classifier=classifier(moe_layers_of(model))) as meter, \
                (activation_offload.recording(model) if offload else contextlib.nullcontext()) as recorder, \
                (checkpoints_by_layer(meter) if full else contextlib.nullcontext()):
            output = model(ids, positions, None, labels=labels)
    result = meter.result()  # while the output keeps the graph and its saved storages alive
    groups = recorder.result(meter.counted) if offload else ()
    del output
    by_category, by_layer = split(result)
    buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    persistent = sum(t.numel() * t.element_size() for t in getattr(buffer, "buffer", {}).values())
    lora_a = {name: nbytes for name, nbytes in result.by_module.items()
              if ".adapter." in name and name.endswith(".linear_in")}
    return TracedMicrobatch(result.total_bytes, by_category, by_layer, persistent, lora_a,
                            split_by_category_and_layer(result),
                            {name: n for name, n in result.by_module.items() if is_dense_linear(name)},
                            {name: n for name, n in result.by_module_alone.items() if is_dense_linear(name)},
                            groups)
