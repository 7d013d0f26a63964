"""Which layers each pipeline stage holds, and how many forwards of each of its model chunks it keeps.

Megatron Core splits a GPT model's decoder layers over PP stages of VPP model chunks each, in one of four
ways (``transformer/transformer_config.py`` L1922-2109 checks them, ``transformer_block.py``
``get_num_layers_to_build`` L70-197 and ``transformer_layer.py`` ``get_transformer_layer_offset`` L59-212
apply them):

* evenly: ``num_layers / PP`` per stage, ``/ VPP`` per chunk;
* ``num_layers_in_first_pipeline_stage`` / ``..._last_...``: those stages take their count, the middle
  stages share the rest evenly (each divided by VPP into chunks);
* ``account_for_embedding_in_pipeline_split`` / ``..._loss_...``: the embedding and the loss count as one
  layer each in the even split, so the first chunk of the first stage and the last chunk of the last stage
  hold one decoder layer fewer;
* ``pipeline_model_parallel_layout`` (``pipeline_parallel_layer_layout.py``): each of the PP x VPP chunks
  listed, chunk ``v`` of stage ``p`` at position ``v * PP + p``.

In every case the layers are numbered chunk by chunk in the order (chunk, stage): chunk 0 of every stage,
then chunk 1, ... (Core's offsets). The embedding is built on the first chunk of the first stage and the output
layer with the loss on the last chunk of the last stage (Bridge's ``GPTModelProvider.provide``: ``pre_process``
and ``post_process`` from ``is_vp_first_stage`` / ``is_vp_last_stage`` and the pipeline rank).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from megatron_bridge_ext.findings import ERROR, Finding

LAYOUT = "model.pipeline_model_parallel_layout"


@dataclass(frozen=True)
class Chunk:
    """One model chunk of a stage: its decoder layers' 0-based global numbers, whether it holds the embedding
    and the loss, and its multi-token-prediction layers."""

    layers: tuple[int, ...]
    embedding: bool = False
    loss: bool = False
    mtp: int = 0


def _sizes(model) -> Optional[list[list[int]]]:
    """Decoder layers per [stage][chunk] as Core splits them, or None where Core refuses the split
    (:func:`split_problems` says why)."""
    pp = model.pipeline_model_parallel_size
    layout = getattr(model, "pipeline_model_parallel_layout", None)
    if layout is not None:
        parsed = parse_layout(layout, pp)
        return [[row.count("decoder") for row in stage] for stage in parsed] if parsed else None
    vpp = (model.virtual_pipeline_model_parallel_size or 1) if pp > 1 else 1
    first = getattr(model, "num_layers_in_first_pipeline_stage", None)
    last = getattr(model, "num_layers_in_last_pipeline_stage", None)
    embedding = bool(getattr(model, "account_for_embedding_in_pipeline_split", False))
    loss = bool(getattr(model, "account_for_loss_in_pipeline_split", False))
    if first is not None or last is not None:
        per_stage = _uneven(model.num_layers, pp, first, last)
    else:
        total = model.num_layers + embedding + loss
        per_stage = [total // pp] * pp if total % pp == 0 else None
    if per_stage is None or any(n % vpp or n < 0 for n in per_stage):
        return None
    sizes = [[n // vpp] * vpp for n in per_stage]
    if first is None and last is None:
        sizes[0][0] -= embedding
        sizes[-1][-1] -= loss
    return sizes if all(n >= 0 for stage in sizes for n in stage) else None


def _uneven(num_layers: int, pp: int, first: Optional[int], last: Optional[int]) -> Optional[list[int]]:
    """Layers per stage with the first and/or last stage's count given: the middle stages share the rest."""
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    if (first is not None and first <= 0) or (last is not None and last <= 0) or middle < 0:
        return None
    if bool(middle) != bool(middle_stages) or (middle_stages and middle % middle_stages):
        return None
    per = middle // middle_stages if middle_stages else 0
    out = [per] * pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


def parse_layout(layout, pp: int) -> Optional[list[list[list[str]]]]:
    """A ``pipeline_model_parallel_layout`` (string, list or Core's ``PipelineParallelLayerLayout``) as
    [stage][chunk] lists of layer type names (``embedding``, ``decoder``, ``mtp``, ``loss``), read with Core's own
    parser; None where Core refuses it."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        parsed = layout if isinstance(layout, PipelineParallelLayerLayout) else PipelineParallelLayerLayout(layout, pp)
    except (AssertionError, ValueError, KeyError):
        return None
    if parsed.pipeline_model_parallel_size != pp:
        return None
    return [[[kind.name for kind in chunk] for chunk in stage] for stage in parsed.layout]


def stage_chunks(model) -> list[list[Chunk]]:
    """Each stage's model chunks with their layers, embedding, loss and MTP layers, as Core builds them.

    Raises ``ValueError`` for a split Core refuses (call :func:`split_problems` first)."""
    sizes = _sizes(model)
    if sizes is None:
        raise ValueError(f"Megatron Core refuses this pipeline split: {split_problems(model)}")
    pp, vpp = len(sizes), len(sizes[0])
    mtp = _mtp_per_chunk(model, pp, vpp)
    out = [[None] * vpp for _ in range(pp)]
    start = 0
    for v in range(vpp):
        for p in range(pp):
            n = sizes[p][v]
            out[p][v] = Chunk(tuple(range(start, start + n)), embedding=(p, v) == (0, 0),
                              loss=(p, v) == (pp - 1, vpp - 1), mtp=mtp[p][v])
            start += n
    return out


def _mtp_per_chunk(model, pp: int, vpp: int) -> list[list[int]]:
    """Multi-token-prediction layers per [stage][chunk]: where a layout puts them, else Core's default (all on the
    last chunk of the last stage, ``multi_token_prediction.py`` ``mtp_on_this_rank``)."""
    out = [[0] * vpp for _ in range(pp)]
    layout = getattr(model, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return [[chunk.count("mtp") for chunk in stage] for stage in parse_layout(layout, pp)]
    out[-1][-1] = getattr(model, "mtp_num_layers", None) or 0
    return out


def final_norm_chunk(model, stage: int) -> Optional[int]:
    """The chunk of ``stage`` that builds the decoder's final norm, None if none does: the chunk with the loss, or
    with multi-token prediction the chunk with the last decoder layer, wherever the split puts it
    (``transformer_block.py`` ``has_final_layernorm_in_this_stage`` L387-413)."""
    last = model.num_layers - 1
    for index, chunk in enumerate(stage_chunks(model)[stage]):
        if (last in chunk.layers) if getattr(model, "mtp_num_layers", None) else chunk.loss:
            return index
    return None


def stage_layers(model, stage: int) -> list[int]:
    """The global numbers of ``stage``'s decoder layers, chunk after chunk."""
    return [layer for chunk in stage_chunks(model)[stage] for layer in chunk.layers]


UNEVEN_FIX = ("choose sizes that divide it, or set num_layers_in_first/last_pipeline_stage or "
              "pipeline_model_parallel_layout")
"""The fix for layers PP does not divide evenly (every check of it, early or on the built model, gives this one)."""


def indivisible(pp: int, layers: int, extra: int = 0) -> str:
    """PP does not divide the layers of an even split, and the line of Megatron Core that refuses it: with the
    embedding or the loss counted as a layer, ``TransformerConfig.__post_init__`` raises (transformer_config.py
    L2076-2080, L2089-2096 with VPP); else the even split of ``get_num_layers_to_build`` asserts when a stage is
    built (transformer_block.py L150-152). Every check of it, early or on the built model, gives this message."""
    counted = f"the {layers} layers" + (f" (+{extra} for embedding/loss)" if extra else "")
    where = ("TransformerConfig raises it, transformer_config.py L2076-2080 / L2089-2096" if extra else
             "Megatron Core's even split asserts it, transformer_block.py L150-152")
    return f"PP={pp} does not divide {counted} ({where})"


def split_problems(model) -> list[Finding]:
    """What Megatron Core refuses about the model's pipeline split, one finding each (empty: Core builds it)."""
    pp = model.pipeline_model_parallel_size
    layout = getattr(model, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return _layout_problems(model, layout, pp)
    vpp = model.virtual_pipeline_model_parallel_size if pp > 1 else None
    uneven = (getattr(model, "num_layers_in_first_pipeline_stage", None) is not None
              or getattr(model, "num_layers_in_last_pipeline_stage", None) is not None)
    accounted = (getattr(model, "account_for_embedding_in_pipeline_split", False)
                 or getattr(model, "account_for_loss_in_pipeline_split", False))
    if uneven and accounted:
        return [_refused("model.account_for_embedding_in_pipeline_split", "cannot be combined with "
                         "num_layers_in_first/last_pipeline_stage (transformer_config.py L1922-1932)",
                         "use one of the two ways to split")]
    if _sizes(model) is not None:
        return []
    if uneven:
        return [_refused("model.num_layers_in_first_pipeline_stage",
                         f"with num_layers_in_last_pipeline_stage leaves middle stages Megatron Core cannot split "
                         f"{model.num_layers} layers over PP={pp}{_vpp_text(vpp)} (each stage's count at least 1, the "
                         "middle stages' share whole" + (" and divisible by VPP" if vpp else "") + ")",
                         "choose first/last counts that leave the middle stages an even share")]
    extra = sum(bool(getattr(model, f"account_for_{part}_in_pipeline_split", False)) for part in ("embedding", "loss"))
    total = model.num_layers + extra
    if total % pp:
        return [_refused("model.pipeline_model_parallel_size", indivisible(pp, model.num_layers, extra), UNEVEN_FIX)]
    return [_refused("model.virtual_pipeline_model_parallel_size",
                     f"VPP={vpp} does not divide the {total // pp} layers of a stage", "choose sizes that divide it")]


def _vpp_text(vpp) -> str:
    return f" x VPP={vpp}" if vpp else ""


def _layout_problems(model, layout, pp: int) -> list[Finding]:
    """Core's checks of a layout (``PipelineParallelLayerLayout.__init__`` and ``validate_layer_layout``,
    transformer_config.py L1936-1986), its message kept."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    others = [name for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
              if getattr(model, name, None) is not None]
    others += [name for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
               if getattr(model, name, False)]
    if others:
        return [_refused(LAYOUT, f"cannot be set with {', '.join(others)} (transformer_config.py L1936-1953)",
                         f"unset {others[0]}")]
    try:
        parsed = layout if isinstance(layout, PipelineParallelLayerLayout) else PipelineParallelLayerLayout(layout, pp)
        vpp = model.virtual_pipeline_model_parallel_size
        assert vpp is None or vpp == parsed.virtual_pipeline_model_parallel_size, (
            f"its {parsed.virtual_pipeline_model_parallel_size} chunks per stage are not "
            f"virtual_pipeline_model_parallel_size={vpp}")
        parsed.validate_layer_layout(num_layers=model.num_layers, mtp_num_layers=getattr(model, "mtp_num_layers", None))
    except (AssertionError, ValueError, KeyError, NotImplementedError) as error:
        return [_refused(LAYOUT, f"Megatron Core refuses it: {str(error).strip() or type(error).__name__}",
                         "list PP x VPP stages with every decoder layer once, the embedding first and the loss last")]
    return []


def _refused(setting: str, message: str, fix: str) -> Finding:
    return Finding("parallel_layout", ERROR, setting, message, fix)


def chunk_forwards(*, pp: int, vpp: Optional[int], num_microbatches: int, stage: int,
                   group_size: Optional[int] = None) -> list[int]:
    """Forwards of each model chunk that pipeline stage ``stage`` holds at its first backward.

    Megatron Core's schedules (``pipeline_parallel/schedules.py``) run ``warmup`` forwards before the first
    backward and then alternate, so ``warmup + 1`` forwards are alive: 1F1B has ``warmup = pp - stage - 1``;
    the interleaved schedule ``warmup = 2 (pp - stage - 1) + (vpp - 1) * group_size`` (group size defaults to
    pp), capped by the step's microbatches times the chunks. The interleaved forwards go to the chunks in the
    order of Core's ``get_schedule_table`` (L962-989): each group of microbatches through chunk 0, then chunk 1,
    ...; so a stage's chunks need not hold the same number (the last chunk of the last stage, with the loss,
    holds the fewest).
    """
    if pp == 1:
        return [1]
    if not vpp or vpp == 1:
        return [min(pp - stage, num_microbatches)]
    group = group_size or pp
    alive = min(2 * (pp - stage - 1) + (vpp - 1) * group + 1, num_microbatches * vpp)
    order = [chunk for start in range(0, num_microbatches, group) for chunk in range(vpp)
             for _ in range(start, min(start + group, num_microbatches))]
    counts = Counter(order[:alive])
    return [counts[chunk] for chunk in range(vpp)]


def candidate_stages(model, kinds: list) -> list[int]:
    """The stages that can be the most loaded: the first of each group of stages that hold the same chunks (layer
    counts and kinds, embedding, loss, MTP, the decoder's final norm). A later stage with the same chunks holds no more forwards in flight
    than an earlier one, so it cannot be heavier. ``kinds``: each global layer's kind (:func:`..build.layer_kinds`,
    or the layer numbers themselves where a layer's build depends on its number)."""
    seen, out = set(), []
    for stage, chunks in enumerate(stage_chunks(model)):
        key = (tuple((tuple(kinds[layer] for layer in c.layers), c.embedding, c.loss, c.mtp) for c in chunks),
               final_norm_chunk(model, stage))
        if key not in seen:
            seen.add(key)
            out.append(stage)
    return out


def is_plain(model) -> bool:
    """An even split without interleaving, in which a stage built alone holds the layers Core gives it."""
    return (getattr(model, "pipeline_model_parallel_layout", None) is None
            and (model.virtual_pipeline_model_parallel_size or 1) == 1
            and getattr(model, "num_layers_in_first_pipeline_stage", None) is None
            and getattr(model, "num_layers_in_last_pipeline_stage", None) is None
            and not getattr(model, "account_for_embedding_in_pipeline_split", False)
            and not getattr(model, "account_for_loss_in_pipeline_split", False))


def flatten(provider, counts: list[int], mtp: Optional[list[int]] = None) -> None:
    """Make ``provider`` (a finalized copy) build each stage as one chunk of ``counts[p]`` decoder layers: a layout
    of one chunk per stage, the embedding on the first and the loss on the last, the other split fields cleared.
    A stage's chunks are then traced as one model; ``mtp``: the MTP layers of each stage, before its loss."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    pp = provider.pipeline_model_parallel_size
    mtp = mtp or [0] * pp
    rows = [(["embedding"] if p == 0 else []) + ["decoder"] * n + ["mtp"] * mtp[p] + (["loss"] if p == pp - 1 else [])
            for p, n in enumerate(counts)]
    provider.pipeline_model_parallel_layout = PipelineParallelLayerLayout(rows, pp)
    provider.num_layers = sum(counts)
    provider.virtual_pipeline_model_parallel_size = None
    provider.num_layers_in_first_pipeline_stage = provider.num_layers_in_last_pipeline_stage = None
    provider.account_for_embedding_in_pipeline_split = provider.account_for_loss_in_pipeline_split = False


@dataclass(frozen=True)
class InFlight:
    """The forwards a stage holds, per model chunk (:func:`chunk_forwards`), and the chunk of each of its traced
    layers (the stage's layers in chunk order): each saved byte counts as many times as its chunk's forwards.
    ``norm_chunk``: the chunk of the decoder's final norm (with multi-token prediction the chunk of the last decoder
    layer, :func:`final_norm_chunk`); ``embedding_chunk``: the chunk whose forwards run the embedding (the first;
    on a later stage the last, where only the MTP depths embed their tokens)."""

    forwards: tuple[int, ...]
    layer_chunks: tuple[int, ...]
    norm_chunk: int = -1
    embedding_chunk: int = 0

    @property
    def mean(self) -> float:
        """Forwards per layer, averaged over the stage's layers (the stage's microbatches in flight when its chunks
        are equal; the first chunk's without layers)."""
        if not self.layer_chunks:
            return float(self.forwards[0])
        return sum(self.forwards[chunk] for chunk in self.layer_chunks) / len(self.layer_chunks)

    def weight(self, category: str, layer: Optional[int]) -> float:
        """How many times what ``layer`` (None: outside the layers) saved in ``category`` is alive: its chunk's
        forwards; the embedding's are :attr:`embedding_chunk`'s, the final norm's :attr:`norm_chunk`'s, the MTP
        depths' and the loss's the last chunk's (Core builds MTP in the last chunk of its stage,
        ``pipeline_parallel_layer_layout.py`` L118-124), other saves outside the layers (full recompute's
        checkpoints) the layers' mean."""
        from megatron_bridge_ext.estimate.trace import EMBEDDING, LOGITS_LOSS, MTP, NORMS

        if layer is not None:
            return float(self.forwards[self.layer_chunks[layer]])
        if category == EMBEDDING:
            return float(self.forwards[self.embedding_chunk])
        if category == NORMS:
            return float(self.forwards[self.norm_chunk])
        if category in (LOGITS_LOSS, MTP):
            return float(self.forwards[-1])
        return self.mean

    def text(self) -> str:
        if len(self.forwards) == 1:
            return f"{self.forwards[0]:g} in flight"
        return f"{self.mean:g} in flight on average (forwards per chunk: {', '.join(map(str, self.forwards))})"
