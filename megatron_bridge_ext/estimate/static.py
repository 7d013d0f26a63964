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
  16-bit parameters live in its parameter buffer, so they are not counted twice. Muon keeps a main copy and
  one momentum for the matrices it steps and its scalar Adam's states for the rest (:mod:`.muon`).

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

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_bridge_ext.estimate import muon, offload
from megatron_bridge_ext.estimate.report import STATIC, Component
from megatron_bridge_ext.findings import ERROR, Finding

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


FUSED_ADAM_MASTERS = (torch.float32, torch.float16)
"""``master_weight_dtype`` values Transformer Engine's FusedAdam accepts (``optimizers/fused_adam.py``,
``FusedAdam.__init__``: "FusedAdam only supports fp32/fp16 master weights")."""


def state_bytes(dtype) -> int:
    """Bytes per element of a precision-aware optimizer state: ``torch.uint8`` is FusedAdam's FP8 state, one byte per
    element in a ``Float8Tensor`` with one fp32 scale per tensor (``_initialize_state``: ``Float8Quantizer``,
    ``make_empty``; the per-tensor scale and amax are left out)."""
    return 1 if dtype == torch.uint8 else dtype_bytes(dtype)


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
    matrices: dict[str, int] = field(default_factory=dict)
    """Trainable parameters per part that Muon itself steps (:func:`.muon.is_matrix`); the rest of ``trainable``
    goes to its scalar optimizer. Read only under Muon."""

    @property
    def total(self) -> int:
        return sum(self.frozen.values()) + sum(self.trainable.values())

    @property
    def trainable_total(self) -> int:
        return sum(self.trainable.values())

    @property
    def trainable_experts(self) -> int:
        return sum(self.trainable[part] for part in EXPERT_PARTS)

    def matrices_of(self, experts: bool) -> int:
        """Muon's matrices among the trainable expert parameters (``experts``) or the others."""
        return sum(n for part, n in self.matrices.items() if (part in EXPERT_PARTS) == experts)


def _layer_index(name: str) -> Optional[int]:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["decoder", "layers"] and parts[2].isdigit() else None


def count_parameters(model: torch.nn.Module, sources: Optional[list[int]] = None) -> ParameterCounts:
    """Parameters of ``model`` per part; ``sources``: the model built a reduced stage, and layer i of the real
    stage has the parameters of built layer ``sources[i]`` (:func:`..memory.traced_layers`)."""
    frozen = dict.fromkeys(PARTS, 0)
    trainable = dict.fromkeys(PARTS, 0)
    matrices = dict.fromkeys(PARTS, 0)
    sizes = set()
    for name, param in model.named_parameters():
        index = _layer_index(name)
        copies = sources.count(index) if sources and index is not None else 1
        (trainable if param.requires_grad else frozen)[part_of(name)] += copies * param.numel()
        if param.requires_grad and muon.is_matrix(param):
            matrices[part_of(name)] += copies * param.numel()
        sizes.add(param.element_size())
    if len(sizes) != 1:
        raise ValueError(f"parameters of {len(sizes)} element sizes {sorted(sizes)}: the model is not cast to one dtype")
    return ParameterCounts(frozen, trainable, sizes.pop(), matrices)


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
    offload_fraction: Optional[float] = None
    """``optimizer_offload_fraction`` with the CPU offload on (:mod:`.offload`): that share of the shard's moments
    (and, with the precision-aware optimizer, of its main copies) lives in host memory."""
    remainders: bool = False
    """The precision-aware main copy is TE's 16-bit remainder of the fp32 value (``store_param_remainders``)."""
    matrix_moment_bytes: tuple[int, ...] = ()
    """Muon (:mod:`.muon`): the moments of the matrices it steps itself, whose main copy is ``main_bytes`` too;
    ``moment_bytes`` are then its scalar Adam's. Empty for every other optimizer."""

    @property
    def masters_offloaded(self) -> bool:
        """The hybrid optimizer makes the precision-aware main copies itself, on the host for the moved part."""
        return self.offload_fraction is not None and self.precision_aware


KNOWN_OPTIMIZERS = ("adam", "sgd") + muon.NAMES


def optimizer_findings(optimizer_config) -> list[Finding]:
    """An optimizer other than Adam, SGD and Muon, refused in one line: Core 0.19 builds the others through
    ``_get_megatron_emerging_optimizer`` (``optimizer/__init__.py`` L1038-1044), whose states are not modelled; and
    the Muon set-ups :mod:`.muon` does not model."""
    name = getattr(optimizer_config, "optimizer", "adam")
    if name in KNOWN_OPTIMIZERS:
        return muon.findings(optimizer_config) + _master_dtype_findings(optimizer_config)
    return [Finding("unsupported_model", ERROR, "optimizer.optimizer",
                    f"{name!r} is not modelled (emerging optimizers other than Muon keep states unlike Adam's)",
                    "estimate with optimizer.optimizer=adam")]


def _master_dtype_findings(optimizer_config) -> list[Finding]:
    """A precision-aware ``main_params_dtype`` FusedAdam refuses where it holds the masters (Core passes it as
    ``master_weight_dtype``, ``optimizer/__init__.py`` L569-580; :func:`.phases.te_holds_masters`)."""
    from megatron_bridge_ext.estimate.phases import te_holds_masters

    dtype = getattr(optimizer_config, "main_params_dtype", torch.float32)
    if not te_holds_masters(optimizer_config) or dtype in FUSED_ADAM_MASTERS \
            or getattr(optimizer_config, "optimizer_cpu_offload", False):
        return []
    return [Finding("optimizer_config", ERROR, "optimizer.main_params_dtype",
                    f"{dtype} master weights are refused by Transformer Engine's FusedAdam (fp32 or fp16 only)",
                    "set optimizer.main_params_dtype=fp32 or fp16")]


def optimizer_rule(optimizer_config, *, param_bytes: int, data_parallel: int, context_parallel: int) -> OptimizerRule:
    """Megatron's optimizer state for one trainable parameter (``OptimizerConfig`` fields).

    The precision-aware optimizer's dtypes (Core 0.19 ``optimizer_config.py`` L187-206; without it each must be fp32,
    L469-481): ``exp_avg_dtype``/``exp_avg_sq_dtype`` fp32, bf16, fp16 or FusedAdam's FP8 (``torch.uint8``,
    :func:`state_bytes`); ``main_params_dtype`` fp32 or fp16 for FusedAdam's masters (:func:`optimizer_findings`),
    its fp32 masters of bf16 parameters stored as 16-bit remainders (:func:`_stores_remainders`), or Core's own fp32
    main copies where FusedAdam does not hold them (``distrib_optimizer.py`` L445, L485-495); ``main_grads_dtype`` is
    read nowhere but in that check: the gradient is the DDP buffer's (``grad_reduce_in_fp32``, :func:`grad_buffer_bytes`).
    """
    name = getattr(optimizer_config, "optimizer", "adam")
    if name not in KNOWN_OPTIMIZERS:
        raise ValueError(f"optimizer.optimizer={name!r}: the estimate knows Adam, SGD and Muon; use one of them")
    if muon.is_muon(optimizer_config):
        return _muon_rule(optimizer_config, param_bytes=param_bytes, shards=data_parallel * context_parallel)
    moments = ["exp_avg", "exp_avg_sq"] if name == "adam" else ["momentum"]
    offloaded = offload.fraction(optimizer_config)
    remainders = False
    if offloaded is not None:
        main = 4 if param_bytes < 4 else 0
        moment_bytes = [4] * len(moments)
        source = (f"hybrid CPU-offload optimizer: fp32 main copy + fp32 moments, {offloaded:g} of the moments"
                  + (" and main copies" if getattr(optimizer_config, "use_precision_aware_optimizer", False) else "")
                  + " on the host")
    elif getattr(optimizer_config, "use_precision_aware_optimizer", False):
        remainders = _stores_remainders(optimizer_config, param_bytes)
        main = 2 if remainders else dtype_bytes(optimizer_config.main_params_dtype)
        moment_bytes = [state_bytes(getattr(optimizer_config, f"{m}_dtype", torch.float32)) for m in moments]
        source = "precision-aware optimizer dtypes" + (", main copy as 16-bit remainders" if remainders else "")
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
                         bool(getattr(optimizer_config, "use_precision_aware_optimizer", False)), offloaded, remainders)


def _muon_rule(optimizer_config, *, param_bytes: int, shards: int) -> OptimizerRule:
    """Muon's matrices: fp32 main copy + fp32 momentum; the rest: its scalar Adam's fp32 main copy + two fp32
    moments (:mod:`.muon`); divided over DP x CP (experts: expert DP) by the layer-wise optimizer only."""
    main = 4 if param_bytes < 4 else 0
    adam = (4, 4)
    layer_wise = muon.layer_wise(optimizer_config)
    terms = (f"matrices {main} + {muon.MOMENTUM_BYTES} = {main + muon.MOMENTUM_BYTES} B (main copy + momentum), "
             f"the others {' + '.join(map(str, ([main] if main else []) + list(adam)))} = {main + sum(adam)} B "
             "(Adam: main copy + exp_avg + exp_avg_sq)")
    description = (f"{optimizer_config.optimizer}: {terms}"
                   + (f", whole parameters dealt over DP x CP = {shards} by the layer-wise optimizer" if layer_wise
                      else ", not distributed"))
    return OptimizerRule(main + sum(adam), shards if layer_wise else 1, description, layer_wise, main, adam,
                         matrix_moment_bytes=(muon.MOMENTUM_BYTES,))


def _stores_remainders(optimizer_config, param_bytes: int) -> bool:
    """TE's FusedAdam keeps an fp32 master of a bf16 parameter as its low 16 bits (int16) when Core passes
    ``store_param_remainders`` (default True; ``optimizer/__init__.py`` L583-584, Core's checkpoint scaffold allocates
    ``torch.int16`` for it, ``distrib_optimizer.py`` L1008-1009) and FusedAdam holds the masters
    (``master_weights``, :func:`.phases.te_holds_masters`) in fp32 (TE ``FusedAdam.__init__``: ``store_param_remainders
    and master_weights and master_weight_dtype == torch.float32``; ``initialize_state`` for ``param.dtype ==
    torch.bfloat16``)."""
    from megatron_bridge_ext.estimate.phases import te_holds_masters

    return (bool(getattr(optimizer_config, "store_param_remainders", True)) and param_bytes == 2
            and bool(getattr(optimizer_config, "bf16", False)) and te_holds_masters(optimizer_config)
            and getattr(optimizer_config, "main_params_dtype", torch.float32) == torch.float32)


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
    shard = optimizer_shard(counts, rule, expert_shards=expert_shards)
    nbytes = shard.masters + shard.moments
    host = "" if rule.offload_fraction is None else \
        f"; on the GPU: all but the {shard.offloaded:,} of {shard.elements:,} shard elements whose state is on the host"
    matrices = "" if not rule.matrix_moment_bytes else f" ({counts.matrices_of(False):,} of them matrices)"
    if not experts:
        out.append(Component(STATIC, "optimizer states", nbytes,
                             f"{trainable:,} trainable parameters{matrices} x {rule.description}{host}"))
        return out
    shards = expert_shards if rule.distributed else 1
    dense = trainable - experts
    per_expert = f"{rule.bytes_per_parameter} B" if not rule.matrix_moment_bytes else \
        f"the same ({counts.matrices_of(True):,} of them matrices)"
    out.append(Component(STATIC, "optimizer states", nbytes,
                         f"{dense:,} trainable parameters{matrices} x {rule.description}{host}; {experts:,} trainable "
                         f"expert parameters x {per_expert}"
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
    offloaded: int = 0
    """Elements whose moments (and precision-aware main copies) the CPU-offload optimizer keeps on the host."""


def optimizer_shard(counts: ParameterCounts, rule: OptimizerRule, *, expert_shards: int = 1) -> OptimizerShard:
    """The rank's optimizer shard, split into main copies and moments on the GPU (``expert_shards`` as in
    :func:`static_components`).

    With the CPU offload each shard (dense, experts: Core builds one distributed optimizer, and so one hybrid
    optimizer, for each) keeps the moments of its GPU part only; its main copies stay whole on the GPU unless the
    precision-aware optimizer has the hybrid optimizer make them (:mod:`.offload`)."""
    experts = counts.trainable_experts
    dense = counts.trainable_total - experts
    split = ((dense, rule.shards), (experts, expert_shards if rule.distributed else 1))
    elements = sum(-(-n // shards) for n, shards in split)
    if rule.matrix_moment_bytes:
        return _muon_shard(counts, rule, split, elements)
    if rule.offload_fraction is None:
        total = sum(-(-n * rule.bytes_per_parameter // shards) for n, shards in split)
        masters = sum(-(-n * rule.main_bytes // shards) for n, shards in split)
        return OptimizerShard(elements, masters, total - masters)
    on_host = [offload.host_elements(-(-n // shards), rule.offload_fraction) for n, shards in split]
    on_gpu = [-(-n // shards) - host for (n, shards), host in zip(split, on_host)]
    if rule.masters_offloaded:
        masters = sum(n * rule.main_bytes for n in on_gpu)
    else:
        masters = sum(-(-n * rule.main_bytes // shards) for n, shards in split)
    return OptimizerShard(elements, masters, sum(on_gpu) * sum(rule.moment_bytes), sum(on_host))


def _muon_shard(counts: ParameterCounts, rule: OptimizerRule, split, elements: int) -> OptimizerShard:
    """Muon's shard: its matrices at main copy + momentum, the rest at its scalar Adam's bytes, dense and experts
    each divided over their ranks."""
    matrix_bytes = rule.main_bytes + sum(rule.matrix_moment_bytes)
    groups = []
    for (n, shards), experts in zip(split, (False, True)):
        matrices = counts.matrices_of(experts)
        groups += [(matrices, shards, matrix_bytes), (n - matrices, shards, rule.bytes_per_parameter)]
    total = sum(-(-n * per // shards) for n, shards, per in groups)
    masters = sum(-(-n * rule.main_bytes // shards) for n, shards, _ in groups)
    return OptimizerShard(elements, masters, total - masters)


def expert_data_parallel(*, data_parallel: int, tensor_parallel: int, context_parallel: int, expert_parallel: int,
                         expert_tensor_parallel: int) -> int:
    """Core's expert-data-parallel size: a stage's GPUs (DP x TP x CP) over one expert grid (EP x ETP)."""
    return max(1, data_parallel * tensor_parallel * context_parallel // (expert_parallel * expert_tensor_parallel))
