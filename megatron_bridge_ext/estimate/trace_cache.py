"""Reuse of a stage's build and trace between estimates that differ only in what the trace does not see.

A stage's trace depends on the model, its TP, SP, CP, EP and ETP, the sequence, the micro-batch, recompute, the
adapters, the precision and the layers built; not on the data-parallel size or the microbatches of a step (they
enter the formulas: the optimizer's shard, :mod:`.static`, and the microbatches in flight, :mod:`.pipeline`). A
stage traced reduced (:func:`.memory.traced_layers`: its first layer and one of each kind that follows) builds the
same layers whatever the pipeline size, so that size is left out of the key too, only whether the stage holds the
embedding (first) and the output layer (last) is kept. ``mbx plan --search`` estimates hundreds of layouts inside
:func:`reuse`; outside it nothing is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

PIPELINE_FIELDS = frozenset({
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage", "microbatch_group_size_per_vp_stage", "pipeline_dtype",
    "variable_seq_lengths", "overlap_p2p_comm", "batch_p2p_comm", "deallocate_pipeline_outputs"})
"""Provider fields that say how layers are split over stages or sent between them: a reduced stage's build does not
read them beyond the stage's first/last place."""

_cache: Optional[dict] = None
hits = 0
misses = 0


@contextlib.contextmanager
def reuse() -> Iterator[None]:
    """Keep every stage's build and trace for the estimates inside; counts :data:`hits` and :data:`misses`. Inside
    another :func:`reuse`, the outer one's traces and counts go on."""
    global _cache, hits, misses
    if _cache is not None:
        yield
        return
    before, _cache, hits, misses = _cache, {}, 0, 0
    try:
        yield
    finally:
        _cache = before


def key(provider, prepared, stage: int, reduced, **options) -> Optional[str]:
    """What a stage's trace depends on, as text; None outside :func:`reuse`. A stage traced whole keeps every field
    (its layers depend on the split)."""
    if _cache is None:
        return None
    pp = provider.pipeline_model_parallel_size
    skip = PIPELINE_FIELDS if reduced else frozenset()
    fields = [(f.name, repr(getattr(provider, f.name, None))) for f in dataclasses.fields(provider)
              if f.name not in skip]
    place = (reduced.pattern, reduced.numbers, stage == 0, stage == pp - 1) if reduced else (stage, pp)
    return repr((fields, place, prepared.local_seq, prepared.micro_batch, str(prepared.dtype), repr(prepared.peft),
                 sorted(options.items())))


def get_or_trace(k: Optional[str], trace: Callable[[], tuple]) -> tuple:
    """The kept result for ``k``, or ``trace()``'s (kept when ``k`` is not None)."""
    global hits, misses
    if k is None:
        return trace()
    if k in _cache:
        hits += 1
        return _cache[k]
    misses += 1
    _cache[k] = trace()
    return _cache[k]
