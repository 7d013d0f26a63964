"""What Transformer Engine's fused norm-linear keeps beyond the local layer spec that is traced.

Transformer Engine does not run here, so the estimate traces Megatron Core's local spec (separate
norm, then ``ColumnParallelLinear``) and adds what TE's contract keeps on top of it. TE's
``LayerNormLinear`` (``transformer_engine/pytorch/module/layernorm_linear.py``, autograd function
``_LayerNormLinear``; v2.4 L356-358 and L437-447, main L427-435 and L526-536) saves the norm's
input and statistics, as the local norm does, and its local norm-output shard ``ln_out``
[s/t, b, h], which it drops only when its weight is frozen *and* it does not return the norm
output. Bridge's LoRA makes it return the norm output (``return_layernorm_output=True``), so:

* Bridge's LoRA-A on the gathered path keeps the gathered [s, b, h] norm output, which the local
  spec's trace measures, and TE keeps its shard next to it: **one shard per such layer is added**;
* CanonicalLoRA gives ``linear_qkv`` three adapters and ``linear_fc1`` two. On the local spec each
  gathers the layer's input for itself (one gathered copy per adapter, as traced); TE gathers once
  and hands the same tensor to all of them: **the copies beyond the first are taken off** the
  traced LoRA inputs;
* our ``regather`` / ``shard_local`` take the non-gathered return, the shard itself: LoRA-A and TE
  keep the same storage, which the trace already counts once: nothing is added;
* a trainable base (full fine-tuning) keeps the norm output either way: nothing is added.

The same contract is implemented, line by line, by the CPU fake the tests use for TE's LoRA path.
In an FP8 layer TE keeps a quantised copy of the shard instead (v2.4 L237 and L245; v2.8 L240, L250-251,
L268), which our LoRA-A cannot share either: :mod:`.te_fp8` counts it, and this contract skips those
layers' shards (``quantised``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

from megatron_bridge_ext.estimate.report import ACTIVATIONS, Component

COLUMN_TARGETS = ("linear_qkv", "linear_fc1", "in_proj")
"""The column-parallel linears TE fuses with the norm before them (``TELayerNormColumnParallelLinear``): attention's
QKV, a dense MLP's first linear, a Mamba mixer's input projection (Core's hybrid spec)."""
SHARDS = "TE norm-output shards (contract)"
"""The component of the norm-output shards TE keeps beside Bridge's LoRA-A (bf16)."""


@dataclass(frozen=True)
class TeContract:
    """What TE's LayerNormLinear changes per microbatch against the traced local spec.

    ``layers``: LayerNormLinears whose LoRA-A keep the gathered norm output, each adding its own
    shard (``shard_bytes`` in all); ``shared_copies``: gathered copies the local spec made for
    CanonicalLoRA's second and later adapters of such a layer, which TE shares (``shared_bytes``).
    """

    layers: int
    shard_bytes: int
    shared_copies: int
    shared_bytes: int


def base_layer_of(module: str) -> str:
    """The adapted layer of a LoRA-A module: ``...linear_qkv`` for ``...linear_qkv.adapter[.adapter_q].linear_in``."""
    return module.split(".adapter.", 1)[0]


def is_te_lora_input(module: str) -> bool:
    """LoRA-A of a column-parallel target that TE fuses with its norm. Not an MoE layer's: a routed expert's
    ``linear_fc1`` takes the dispatched tokens, and a shared expert's is a plain ``TEColumnParallelLinear``
    (Core's ``moe_module_specs``: the MoE layer's norm is its own ``pre_mlp_layernorm``, before the router)."""
    layer = base_layer_of(module)
    return (layer.rsplit(".", 1)[-1] in COLUMN_TARGETS and ".mlp.experts." not in layer
            and ".mlp.shared_experts." not in layer)


def norm_output_contract(lora_a_saved: dict[str, int], *, seq: int, micro_batch: int, hidden: int, tp: int,
                         sequence_parallel: bool, element_size: int,
                         quantised: Callable[[str], bool] = lambda base: False) -> TeContract:
    """TE's contract against the trace, from what each LoRA-A saved (per module).

    A LoRA-A that saved at least the gathered [s, b, h] input is on Bridge's gathered path. ``quantised``:
    the adapted layers whose shard TE keeps quantised, an FP8 layer's (counted by :mod:`.te_fp8`, not here);
    their adapters still share the gathered copy.
    """
    if not sequence_parallel or tp == 1:
        return TeContract(0, 0, 0, 0)
    gathered = seq * micro_batch * hidden * element_size
    per_layer: dict[str, int] = {}
    for module, nbytes in lora_a_saved.items():
        if is_te_lora_input(module) and nbytes >= gathered:
            per_layer[base_layer_of(module)] = per_layer.get(base_layer_of(module), 0) + 1
    layers = sum(1 for base in per_layer if not quantised(base))
    copies = sum(n - 1 for n in per_layer.values())
    return TeContract(layers, layers * gathered // tp, copies, copies * gathered)


def te_component(contract: TeContract, in_flight: float, *, shard_shape: str) -> Component:
    return Component(
        ACTIVATIONS, SHARDS, round(contract.shard_bytes * in_flight),
        f"Transformer Engine contract: {contract.layers} LayerNormLinear(s) whose LoRA-A keep the gathered norm output "
        f"also keep their own {shard_shape} shard (layernorm_linear.py v2.4 L356-358) x {in_flight:g} microbatch(es)")


MODELLED_VERSION = "2.17.1"
"""The Transformer Engine release whose kernels the estimate's contracts and stand-ins follow (their docstrings cite
its source lines)."""


@contextlib.contextmanager
def version_checks_of_the_modelled_release(module) -> Iterator[None]:
    """Where Transformer Engine is not installed, ``module``'s ``is_te_min_version`` / ``get_te_version`` (Core's
    ``megatron.core.utils`` functions it imported) answer for :data:`MODELLED_VERSION`, as on a cluster that has it:
    Bridge's ``CommOverlapConfig.setup`` asserts TE >= 2.7.0 for ``delay_wgrad_compute`` with overlap
    (``training/comm_overlap.py`` L522-529), which a config estimated here would fail on TE's absence alone. Where TE
    is installed its own version answers."""
    from packaging.version import Version

    from megatron.core.extensions.transformer_engine import HAVE_TE

    if HAVE_TE:
        yield
        return
    saved = {name: getattr(module, name) for name in ("is_te_min_version", "get_te_version") if hasattr(module, name)}
    modelled = Version(MODELLED_VERSION)
    replacements = {"is_te_min_version": lambda version, check_equality=True:
                    modelled >= Version(version) if check_equality else modelled > Version(version),
                    "get_te_version": lambda: modelled}
    for name in saved:
        setattr(module, name, replacements[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
