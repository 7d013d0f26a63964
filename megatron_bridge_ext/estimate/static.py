"""Weights, gradients and optimizer states of one rank: counted parameters, Megatron's storage rules.

Parameters are counted on the model the rank builds (:mod:`.build`), so TP shards, vocabulary
padding, this pipeline stage's layers, its embedding or output layer, and the adapters a PEFT adds
are exact. What each parameter costs follows Megatron Core's rules:

* weights: every parameter in the model's training dtype (``Float16Module`` casts adapters too);
* gradients: Megatron's DDP allocates its contiguous grad buffer (``main_grad``) for parameters
  with ``requires_grad`` only (``DistributedDataParallel`` skips frozen ones), in fp32 with
  ``grad_reduce_in_fp32`` and in the parameter dtype otherwise;
* optimizer: for trainable parameters only, Adam's two moments plus, for 16-bit parameters, the
  fp32 main copy (4 + 4 + 4 bytes; a precision-aware optimizer uses its configured dtypes),
  divided over DP x CP ranks by the distributed optimizer. With the distributed optimizer the
  16-bit parameters live in its parameter buffer, so they are not counted twice.

Mixture-of-experts layers: the rank builds only its local experts (experts / EP, each sharded over
ETP), counted as their own part ``experts``, with LoRA adapters on them as ``expert adapters``; the
router and shared experts stay in ``transformer layers`` (every rank has them). Trainable expert
parameters (full fine-tuning, or expert adapters) have their optimizer state divided over the
expert-data-parallel ranks instead: the distributed optimizer shards expert parameters over Core's
expert-DP group, DP x TP x CP / (EP x ETP) ranks (Core folds the expert layout onto the same GPUs).
Frozen experts (LoRA) have no gradient and no optimizer state.

This is where a PEFT run differs most from Bridge's ``estimate_training_memory``, which charges
every parameter 18 bytes (6 + 12 / DP with the distributed optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bridge_ext.estimate.report import STATIC, Component

EMBEDDING = "embedding"
LAYERS = "transformer layers"
OUTPUT_LAYER = "output layer"
ADAPTERS = "adapters"
EXPERTS = "experts"
EXPERT_ADAPTERS = "expert adapters"
PARTS = (EMBEDDING, LAYERS, EXPERTS, OUTPUT_LAYER, ADAPTERS, EXPERT_ADAPTERS)
EXPERT_PARTS = (EXPERTS, EXPERT_ADAPTERS)
"""The parts whose optimizer state the expert-data-parallel ranks divide."""

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}


def dtype_bytes(dtype) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported by the estimate; use float32, bfloat16 or float16") from None


def part_of(name: str) -> str:
    """Where a parameter of a GPTModel belongs, by name (routed experts: ``...mlp.experts.local_experts...``)."""
    routed = ".mlp.experts." in name
    if ".adapter." in name:
        return EXPERT_ADAPTERS if routed else ADAPTERS
    if routed:
        return EXPERTS
    if name.startswith("embedding."):
        return EMBEDDING
    if name.startswith("output_layer."):
        return OUTPUT_LAYER
    return LAYERS


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of one rank per part, split into frozen and trainable, and their bytes per element."""

    frozen: dict[str, int]
    trainable: dict[str, int]
    element_size: int

    @property
    def total(self) -> int:
        return sum(self.frozen.values()) + sum(self.trainable.values())

    @property
    def trainable_total(self) -> int:
        return sum(self.trainable.values())

    @property
    def trainable_experts(self) -> int:
        return sum(self.trainable[part] for part in EXPERT_PARTS)


def _layer_index(name: str) -> Optional[int]:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["decoder", "layers"] and parts[2].isdigit() else None


def count_parameters(model: torch.nn.Module, sources: Optional[list[int]] = None) -> ParameterCounts:
    """Parameters of ``model`` per part; ``sources``: the model built a reduced stage, and layer i of the real
    stage has the parameters of built layer ``sources[i]`` (:func:`..memory.traced_layers`)."""
    frozen = dict.fromkeys(PARTS, 0)
    trainable = dict.fromkeys(PARTS, 0)
    sizes = set()
    for name, param in model.named_parameters():
        index = _layer_index(name)
        copies = sources.count(index) if sources and index is not None else 1
        (trainable if param.requires_grad else frozen)[part_of(name)] += copies * param.numel()
        sizes.add(param.element_size())
    if len(sizes) != 1:
        raise ValueError(f"parameters of {len(sizes)} element sizes {sorted(sizes)}: the model is not cast to one dtype")
    return ParameterCounts(frozen, trainable, sizes.pop())


@dataclass(frozen=True)
class OptimizerRule:
    """Bytes of optimizer state per trainable parameter, and the ranks the state is divided over."""

    bytes_per_parameter: int
    shards: int
    description: str
    distributed: bool = False
    main_bytes: int = 0
    moment_bytes: tuple[int, ...] = ()
    precision_aware: bool = False
    """``main_bytes`` + ``moment_bytes`` = ``bytes_per_parameter``: the main copy and each moment apart, which the
    phases of a run hold at different times (:mod:`.phases`)."""


def optimizer_rule(optimizer_config, *, param_bytes: int, data_parallel: int, context_parallel: int) -> OptimizerRule:
    """Megatron's optimizer state for one trainable parameter (``OptimizerConfig`` fields)."""
    name = getattr(optimizer_config, "optimizer", "adam")
    if name not in ("adam", "sgd"):
        raise ValueError(f"optimizer.optimizer={name!r}: the estimate knows Adam and SGD; use one of them")
    moments = ["exp_avg", "exp_avg_sq"] if name == "adam" else ["momentum"]
    if getattr(optimizer_config, "use_precision_aware_optimizer", False):
        main = dtype_bytes(optimizer_config.main_params_dtype)
        moment_bytes = [dtype_bytes(getattr(optimizer_config, f"{m}_dtype", torch.float32)) for m in moments]
        source = "precision-aware optimizer dtypes"
    else:
        main = 4 if param_bytes < 4 else 0  # fp32 parameters are their own main copy
        moment_bytes = [4] * len(moments)
        source = "fp32 main copy + fp32 moments" if main else "fp32 moments (fp32 parameters are the main copy)"
    distributed = bool(getattr(optimizer_config, "use_distributed_optimizer", False))
    shards = data_parallel * context_parallel if distributed else 1
    per = main + sum(moment_bytes)
    terms = " + ".join(str(b) for b in ([main] if main else []) + moment_bytes)
    description = (f"{name}: {terms} = {per} B ({source})"
                   + (f", distributed over DP x CP = {shards}" if distributed else ", not distributed"))
    return OptimizerRule(per, shards, description, distributed, main, tuple(moment_bytes),
                         bool(getattr(optimizer_config, "use_precision_aware_optimizer", False)))


def grad_buffer_bytes(ddp_config, param_bytes: int) -> int:
    """Bytes per element of DDP's gradient buffer: fp32 with ``grad_reduce_in_fp32``, else the parameter dtype's
    (Megatron Core 0.19 ``distributed/param_and_grad_buffer.py`` L889, ``group_params_for_buffers``: "grad_dtype:
    torch.float if grad_reduce_in_fp32, else param.dtype")."""
    return 4 if getattr(ddp_config, "grad_reduce_in_fp32", False) else param_bytes


def static_components(counts: ParameterCounts, *, grad_bytes: int, rule: OptimizerRule,
                      expert_shards: int = 1, stored_apart: Optional[dict[str, int]] = None) -> list[Component]:
    """Weights per part, the grad buffer and the optimizer state of one rank.

    ``expert_shards``: the ranks the distributed optimizer divides trainable expert parameters' state
    over (expert DP; :func:`expert_data_parallel`), where ``rule.shards`` divides the others'.
    ``stored_apart``: parameters per part (the transformer layers', the experts') that another component counts in
    their own storage (FP8 parameters, :mod:`.precision`); their gradients and optimizer states are counted here.
    """
    out = []
    size = counts.element_size
    for part in PARTS:
        frozen, trainable = counts.frozen[part], counts.trainable[part]
        if frozen + trainable == 0:
            continue
        split = ", ".join(f"{n:,} {label}" for n, label in ((frozen, "frozen"), (trainable, "trainable")) if n)
        apart = (stored_apart or {}).get(part, 0)
        basis = f"{split} parameters x {size} B" if not apart else \
            f"{split} parameters, less {apart:,} stored as FP8 (counted on their own line), x {size} B"
        out.append(Component(STATIC, f"weights: {part}", (frozen + trainable - apart) * size, basis))
    trainable = counts.trainable_total
    out.append(Component(STATIC, "gradients (main_grad buffer)", trainable * grad_bytes,
                         f"{trainable:,} trainable parameters x {grad_bytes} B; frozen parameters have none"))
    experts = counts.trainable_experts
    if not experts:
        out.append(Component(STATIC, "optimizer states", -(-trainable * rule.bytes_per_parameter // rule.shards),
                             f"{trainable:,} trainable parameters x {rule.description}"))
        return out
    shards = expert_shards if rule.distributed else 1
    dense = trainable - experts
    nbytes = -(-dense * rule.bytes_per_parameter // rule.shards) + -(-experts * rule.bytes_per_parameter // shards)
    out.append(Component(STATIC, "optimizer states", nbytes,
                         f"{dense:,} trainable parameters x {rule.description}; {experts:,} trainable expert "
                         f"parameters x {rule.bytes_per_parameter} B"
                         + (f", distributed over expert DP = DP x TP x CP / (EP x ETP) = {shards}"
                            if rule.distributed else ", not distributed")))
    return out


@dataclass(frozen=True)
class OptimizerShard:
    """The rank's share of the optimizer: its elements and the bytes of the main copies and of the moments.

    Rounded as :func:`static_components` rounds the whole (each part's bytes up), so that ``masters + moments``
    is the ``optimizer states`` line exactly; ``elements``: trainable parameters of the rank's shard.
    """

    elements: int
    masters: int
    moments: int


def optimizer_shard(counts: ParameterCounts, rule: OptimizerRule, *, expert_shards: int = 1) -> OptimizerShard:
    """The rank's optimizer shard, split into main copies and moments (``expert_shards`` as in
    :func:`static_components`)."""
    experts = counts.trainable_experts
    dense = counts.trainable_total - experts
    split = ((dense, rule.shards), (experts, expert_shards if rule.distributed else 1))
    total = sum(-(-n * rule.bytes_per_parameter // shards) for n, shards in split)
    masters = sum(-(-n * rule.main_bytes // shards) for n, shards in split)
    elements = sum(-(-n // shards) for n, shards in split)
    return OptimizerShard(elements, masters, total - masters)


def expert_data_parallel(*, data_parallel: int, tensor_parallel: int, context_parallel: int, expert_parallel: int,
                         expert_tensor_parallel: int) -> int:
    """Core's expert-data-parallel size: a stage's GPUs (DP x TP x CP) over one expert grid (EP x ETP)."""
    return max(1, data_parallel * tensor_parallel * context_parallel // (expert_parallel * expert_tensor_parallel))
