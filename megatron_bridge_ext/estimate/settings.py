"""What an estimate was made for: the layout, the model's shapes and the training choices, as one frozen object.

:class:`Settings` is built once by :mod:`.memory` and read by attribute everywhere (the roofline, the levers'
costs and advice, the planner, the commands): a misspelt name is an ``AttributeError`` where it is written, not
a None far from it. The parts a config may not have are None when absent: :class:`PeftSettings` (full
fine-tuning), :class:`HybridSettings` (a GPT model), :class:`MoeSettings` (a dense model), :class:`MlaSettings`
(a model without multi-latent attention).

:meth:`Settings.to_json` is the flat dict ``mbx plan --json`` prints under ``estimate.settings`` (its keys and their
order are part of that output); :meth:`Settings.from_json` reads it back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.mamba import MambaShapes


@dataclass(frozen=True, slots=True)
class PeftSettings:
    """The adapters the config trains (the estimate's ``peft`` keys)."""

    name: str
    """The PEFT config's class, ``module.Class`` (JSON ``peft``)."""
    kind: Optional[str]
    """Its LoRA-family kind, ``lora``, ``dora`` or ``canonical_lora``; None for another PEFT (JSON ``peft_kind``)."""
    lora_dim: Optional[int]
    """The adapters' rank r (the config's ``dim``; None where it has none)."""
    lora_targets: tuple[str, ...]
    """The config's ``target_modules``, as it names them."""
    sequence_parallel_input_strategy: str
    """The LoRA-A input strategy in effect: ``off``, ``regather`` or ``shard_local``."""

    def to_json(self) -> dict[str, Any]:
        return {"peft": self.name, "peft_kind": self.kind, "lora_dim": self.lora_dim,
                "lora_targets": list(self.lora_targets),
                "sequence_parallel_input_strategy": self.sequence_parallel_input_strategy}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PeftSettings:
        return cls(d["peft"], d["peft_kind"], d["lora_dim"], tuple(d["lora_targets"]),
                   d["sequence_parallel_input_strategy"])


NO_PEFT_JSON = {"peft": None, "peft_kind": None}
"""What :meth:`Settings.to_json` says of full fine-tuning (the PEFT keys that are there whatever the config)."""


@dataclass(frozen=True, slots=True)
class HybridSettings:
    """A hybrid (Mamba) model's estimated stage."""

    layers: dict[str, int]
    """The stage's layers by kind, ``Mamba``, ``attention``, ``MLP``, ``MoE``, those it has (JSON ``hybrid_layers``)."""
    mamba: Optional[MambaShapes]
    """The whole Mamba mixer's sizes (TP 1); None when the pattern has no Mamba layer."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hybrid_layers": dict(self.layers)}
        if self.mamba is not None:
            out["mamba"] = dataclasses.asdict(self.mamba)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HybridSettings:
        mamba = None
        if "mamba" in d:
            from megatron_bridge_ext.estimate.mamba import MambaShapes

            mamba = MambaShapes(**d["mamba"])
        return cls(dict(d["hybrid_layers"]), mamba)


@dataclass(frozen=True, slots=True)
class ReportSettings:
    """What decides when Bridge prints memory, when CUDA-graph pools appear and what the last stage defers."""

    log_interval: int
    """``logger.log_interval``: Bridge prints memory every so many iterations (1 when unset)."""
    train_iters: Optional[int]
    """``train.train_iters``: the run's last iteration; None when unset."""
    cuda_graph_first_iteration: Optional[int]
    """The iteration CUDA-graph pools appear in (warm-up steps + 1); None without CUDA graphs."""
    wgrad_deferral_limit: Optional[int]
    """The model's ``wgrad_deferral_limit`` under ``defer_embedding_wgrad_compute``; None without the deferral."""

    def to_json(self) -> dict[str, Any]:
        return {"log_interval": self.log_interval, "train_iters": self.train_iters,
                "cuda_graph_first_iteration": self.cuda_graph_first_iteration,
                "wgrad_deferral_limit": self.wgrad_deferral_limit}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReportSettings:
        return cls(d["log_interval"], d["train_iters"], d["cuda_graph_first_iteration"], d["wgrad_deferral_limit"])


@dataclass(frozen=True, slots=True)
class MoeSettings:
    """A mixture-of-experts model's experts, their layout and the load the estimate traced them under."""

    experts: int
    """Routed experts per MoE layer (JSON ``num_moe_experts``)."""
    topk: int
    """Experts each token is routed to (JSON ``moe_router_topk``)."""
    ffn: Optional[int]
    """The model's ``moe_ffn_hidden_size`` as set (JSON ``moe_ffn``)."""
    ep: int
    """Expert-parallel size."""
    etp: int
    """Expert tensor-parallel size (Core's default filled in)."""
    local_experts: int
    """Routed experts on one EP rank: ``experts // ep``."""
    dispatcher: str
    """The token dispatcher: ``alltoall``, ``allgather`` or ``flex`` (JSON ``moe_token_dispatcher``)."""
    imbalance: float
    """The stated load: 1.0 balanced, else the most loaded expert's share over that (JSON ``moe_imbalance``)."""
    layers_on_stage: int
    """MoE layers on the estimated stage (JSON ``moe_layers_on_stage``)."""
    routed_tokens_per_layer: int
    """Tokens that reach the traced rank's experts per MoE layer and microbatch."""
    shared_ffn: int
    """The shared experts' width, 0 without shared experts (JSON ``moe_shared_ffn``)."""

    def to_json(self) -> dict[str, Any]:
        return {"num_moe_experts": self.experts, "moe_router_topk": self.topk, "moe_ffn": self.ffn, "ep": self.ep,
                "etp": self.etp, "local_experts": self.local_experts, "moe_token_dispatcher": self.dispatcher,
                "moe_imbalance": self.imbalance, "moe_layers_on_stage": self.layers_on_stage,
                "routed_tokens_per_layer": self.routed_tokens_per_layer, "moe_shared_ffn": self.shared_ffn}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MoeSettings:
        return cls(d["num_moe_experts"], d["moe_router_topk"], d["moe_ffn"], d["ep"], d["etp"], d["local_experts"],
                   d["moe_token_dispatcher"], d["moe_imbalance"], d["moe_layers_on_stage"],
                   d["routed_tokens_per_layer"], d["moe_shared_ffn"])


@dataclass(frozen=True, slots=True)
class MlaSettings:
    """A multi-latent attention model's latent ranks and head widths (Megatron Core's ``MLATransformerConfig``)."""

    q_lora_rank: Optional[int]
    """The query's latent; None: the query projected directly from the hidden state (JSON ``mla_q_lora_rank``)."""
    kv_lora_rank: int
    """The keys' and values' latent (JSON ``mla_kv_lora_rank``)."""
    qk_head_dim: int
    """Query and key width per head without RoPE (JSON ``mla_qk_head_dim``)."""
    qk_pos_emb_head_dim: int
    """Query and key width per head with RoPE, one key part shared by the heads (JSON ``mla_qk_pos_emb_head_dim``)."""
    v_head_dim: int
    """Value width per head (JSON ``mla_v_head_dim``)."""

    @property
    def q_head_dim(self) -> int:
        """Query and key width per head, as core attention takes them."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def to_json(self) -> dict[str, Any]:
        return {f"mla_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MlaSettings:
        return cls(**{f.name: d[f"mla_{f.name}"] for f in dataclasses.fields(cls)})


@dataclass(frozen=True, slots=True)
class Settings:
    """One estimate's settings: the layout of the estimated rank, the model's shapes, the training choices, and the
    parts a config may lack (None when absent). :meth:`to_json` gives the flat dict of ``mbx plan --json``."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    vpp: Optional[int]
    """Virtual pipeline (interleaved) size; None without interleaving."""
    cp: int
    """Context-parallel size."""
    dp: int
    """Data-parallel size."""
    sequence_parallel: bool
    """Sequence parallelism in effect (on, with TP > 1)."""
    seq_length: int
    """Sequence length in tokens."""
    micro_batch: int
    """Micro-batch size."""
    num_microbatches: int
    """Microbatches per step on a data-parallel replica."""
    dtype: str
    """The parameters' training dtype: ``bfloat16``, ``float16`` or ``float32``."""
    fp8: Optional[str]
    """The model's FP8 settings in words; None when the linears do not run in FP8."""
    stage: int
    """The estimated pipeline stage (the most loaded one)."""
    layers_on_stage: int
    """Transformer layers on that stage."""
    hidden: int
    """Hidden size h."""
    ffn: int
    """The dense MLP's width."""
    heads: int
    """Attention heads."""
    query_groups: int
    """Key/value heads (the heads without grouped-query attention)."""
    kv_channels: int
    """Width of one attention head."""
    num_layers: int
    """The model's layers, every stage together."""
    gated_linear_unit: bool
    """The MLP's fc1 is gated (SwiGLU): twice as wide."""
    vocab_size: int
    """Vocabulary size."""
    recompute_granularity: Optional[str]
    """``full``, ``selective`` or None."""
    recompute_modules: tuple[str, ...]
    """The modules selective recompute repeats (as the model config lists them)."""
    attention: str
    """How the attention core was traced: ``fused`` (the flash/cuDNN stand-in) or ``local`` (Core's unfused)."""
    transformer_impl: str
    """``transformer_engine`` (its contract modelled) or ``local`` (Core's local spec)."""
    device: str
    """The device type the ops were traced for: ``cuda`` or ``cpu``."""
    distributed_optimizer: bool
    """The optimizer's states are sharded over data parallelism."""
    peft: Optional[PeftSettings]
    """The adapters; None under full fine-tuning."""
    hybrid: Optional[HybridSettings]
    """A hybrid model's stage; None for a GPT model."""
    reports: ReportSettings
    """When Bridge prints memory and what it defers."""
    moe: Optional[MoeSettings]
    """The experts; None for a dense model."""
    mla: Optional[MlaSettings]
    """Multi-latent attention's sizes; None for a model without it."""
    tp_comm_overlap: bool = False
    """TP's collectives overlap the linears: ``tp_comm_overlap`` as Bridge's ``CommOverlapConfig.setup`` leaves it (on
    only with TP > 1 and SP: comm_overlap.py L442-451); a key older JSONs lack, read as off."""
    fsdp: Optional[str] = None
    """Megatron-FSDP's ``data_parallel_sharding_strategy`` with it on; None without (older JSONs lack the key)."""
    moment_bytes: int = 8
    """Bytes of Adam's two moments per element (8 in fp32; the precision-aware optimizer's dtypes); older JSONs lack
    the key, read as fp32."""
    optimizer_offload: Optional[float] = None
    """``optimizer_offload_fraction`` with ``optimizer_cpu_offload`` on, None with it off (older JSONs lack the key)."""
    optimizer_offload_overlap: bool = False
    """``overlap_cpu_optimizer_d2h_h2d``: the offloaded optimizer's copies on side streams."""

    def to_json(self) -> dict[str, Any]:
        """The flat dict of ``mbx plan --json``: the layout and shapes, the PEFT keys, a hybrid model's, the report
        settings, an MoE model's, multi-latent attention's, in that order (lists where this holds tuples)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _PARTS}
        out["recompute_modules"] = list(self.recompute_modules)
        out.update(self.peft.to_json() if self.peft else NO_PEFT_JSON)
        out.update(self.hybrid.to_json() if self.hybrid else {})
        out.update(self.reports.to_json())
        out.update(self.moe.to_json() if self.moe else {})
        out.update(self.mla.to_json() if self.mla else {})
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Settings:
        """The settings :meth:`to_json` gave as ``d`` (e.g. a committed ``--json``); ValueError naming any key it
        does not know."""
        core = {f.name: d[f.name] for f in dataclasses.fields(cls)
                if f.name not in _PARTS and (f.name in d or f.default is dataclasses.MISSING)}
        core["recompute_modules"] = tuple(core["recompute_modules"])
        out = cls(**core, peft=PeftSettings.from_json(d) if d["peft"] is not None else None,
                  hybrid=HybridSettings.from_json(d) if "hybrid_layers" in d else None,
                  reports=ReportSettings.from_json(d),
                  moe=MoeSettings.from_json(d) if "num_moe_experts" in d else None,
                  mla=MlaSettings.from_json(d) if "mla_kv_lora_rank" in d else None)
        unknown = [k for k in d if k not in out.to_json()]
        if unknown:
            raise ValueError(f"estimate settings: unknown key(s) {', '.join(unknown)}; the keys are those of "
                             "Settings.to_json()")
        return out


_PARTS = ("peft", "hybrid", "reports", "moe", "mla")
"""The fields of :class:`Settings` that are parts of their own (each with its own keys in :meth:`Settings.to_json`)."""
