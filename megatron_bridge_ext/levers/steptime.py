"""A step time per rank, calibrated on NVIDIA's published throughput, so that the plan can say what each option costs.

The model, stated once (every term is a function below). Its only fitted numbers are the three of
:mod:`.calibration` (fitted on Megatron Bridge's published performance summaries: median error 15.5% of
TFLOP/s/GPU over 107 rows of five GPU kinds, 6.8% on the 47 dense rows; ``scripts/steptime_published.py``):

* **compute**: the GEMM FLOPs of one microbatch on a rank of the last pipeline stage (the slowest), from the shapes
  in the estimate's settings. Forward: 2 FLOPs per multiply-add of every linear (QKV, attention output, MLP, the
  output layer on the last stage) and of the attention core. Backward: twice the forward for trainable linears
  (input and weight gradient), once for frozen ones (LoRA's base layers and, under PEFT, the output layer), twice
  for the attention core. Recomputed modules add their forward (:mod:`.recompute.cost`); layernorm recompute reads
  and writes [s, b, h] per norm at HBM bandwidth. Each linear runs at the efficiency of its GEMM's per-GPU size
  (:func:`.calibration.gemm_efficiency`: a fraction of the datasheet's dense peak, BF16 or FP8 when the config
  trains in FP8, saturating in the GEMM's FLOPs); the output layer in BF16; the attention core (causal: half the
  s x s, :data:`CAUSAL_CORE`) and Mamba scans in BF16 at a large GEMM's fraction. LoRA's own small GEMMs and
  elementwise kernels are left out.
* **tensor parallelism**: the activation all-gathers and reduce-scatters of
  :func:`.parallelism.cost.tp_collective_bytes`, plus the LoRA-A input strategy's collectives
  (:func:`.lora_input.cost.collective_elements`), each sending (t - 1)/t of its size from a rank, on NVLink when the
  TP group fits the NVLink domain (8 GPUs, 72 on an NVL72 rack), else on InfiniBand. With ``tp_comm_overlap`` (as
  Bridge's comm_overlap.py leaves it: TP > 1 and SP) only what the linears' time cannot cover is exposed
  (:func:`tp_exposed`), else all of it.
* **context parallelism**: the ring attention's K and V exchange (:func:`cp_bytes`), under the attention core: only
  its excess is exposed.
* **expert dispatch** (MoE): the token dispatch and combine of every MoE layer, forward and backward
  (:func:`.parallelism.cost.dispatch_bytes_per_layer`, balanced routing), on NVLink when the EP x ETP grid fits the
  domain, else InfiniBand; not overlapped (Bridge turns ``overlap_moe_expert_parallel_comm`` off by default). An MoE
  layer's compute is its router, its routed experts (T*k token copies through fc1 and fc2, GEMMs per local expert)
  and its shared experts (:func:`.recompute.cost.moe_layer_flops`).
* **pipeline**: each microbatch's p2p send of the stage's output and of its input's gradient
  (:func:`.parallelism.cost.p2p_bytes`), exposed without VPP and hidden with it (Bridge's ``overlap_p2p_comm``,
  comm_overlap.py L453-457); and the bubble: the step runs ``m + (pp - 1)/vpp`` microbatch times (1F1B,
  interleaved with vpp chunks), i.e. the bubble is ``(pp - 1)/(vpp m)`` of the ideal.
* **data parallelism**: the gradients' reduce-scatter (fp32, Bridge's ``grad_reduce_in_fp32``) and the parameters'
  all-gather (bf16) with the distributed optimizer, an fp32 all-reduce (twice the bytes) without it, (dp - 1)/dp of
  the trainable parameters on the rank (experts' over the expert-DP group), overlapped with the backward
  (``overlap_grad_reduce``, ``overlap_param_gather``: comm_overlap.py L575-579): only what exceeds the step's
  compute time is counted. Under Megatron-FSDP (:func:`fsdp_bytes_per_parameter`) the layers' all-gathers and
  reduce-scatters run every microbatch; the assumption is the same overlap: Core prefetches the next layers' gathers
  and reduce-scatters on side streams (``megatron_fsdp.py`` L405-417, ``param_and_grad_buffer.py`` L4380-4520), so
  only what exceeds the step's compute is counted.
* **optimizer**: Adam's step on the rank's shard at HBM bandwidth (:func:`optimizer_seconds`); with the optimizer
  offloaded to the CPU (``optimizer_cpu_offload``) the offloaded share steps on the host instead, its gradients and
  parameters crossing the host link (:func:`host_optimizer_seconds`).
* **CPU offloading**: the activation bytes to the host and back over the host link (one direction at a
  time), overlapped with the compute of the other layers (Core copies on a side stream, layer by
  layer): the step pays what exceeds its compute time, and at least one layer's share (the first
  reload of the backward waits for it).
* **expandable segments**: no time (an allocator setting; the published run saw no change).

A lever's change is ``time(after) / time(before) - 1``; the plan prints it against the config as is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Optional

from megatron_bridge_ext.levers import calibration

if TYPE_CHECKING:
    from megatron_bridge_ext.estimate.settings import Settings

NODE_GPUS = 8
"""GPUs per node joined by NVLink (DGX/HGX H100, H200, B200, B300); larger groups cross nodes on InfiniBand."""
GRAD_BYTES = 4
"""Gradient bytes per parameter in the DP reduce-scatter: fp32, Bridge's ``grad_reduce_in_fp32``."""
PARAM_GATHER_BYTES = 2
"""Parameter bytes per parameter in the distributed optimizer's all-gather (bf16 weights)."""

H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 SXM column"
H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column"
B200_SHEET = "NVIDIA HGX B200 / DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200), per GPU (system / 8)"
B300_SHEET = "NVIDIA HGX B300 datasheet (nvidia.com/en-us/data-center/hgx), per GPU (system / 8)"
GB200_SHEET = "NVIDIA GB200 NVL72 datasheet (nvidia.com/en-us/data-center/gb200-nvl72), per GPU (rack / 72)"
GB300_SHEET = "NVIDIA GB300 NVL72 datasheet (nvidia.com/en-us/data-center/gb300-nvl72), per GPU (rack / 72)"
DGX_NETWORK = "DGX H100/H200/B200 datasheets: 8x ConnectX-7 400 Gb/s InfiniBand per node, one per GPU"
CX8_NETWORK = "ConnectX-8 SuperNIC 800 Gb/s InfiniBand, one per GPU"
NVL72 = 72
HOST_MEMORY = {
    "h100": ("DGX H100 datasheet: 2x Intel Xeon Platinum 8480C, each 8 channels of DDR5-4800 (Intel ark: 307.2 GB/s a "
             "socket); 614.4 GB/s a node over 8 GPUs", 76.8e9),
    "h200": ("DGX H200 datasheet: the DGX H100's 2x Xeon Platinum 8480C, DDR5-4800; 614.4 GB/s a node over 8 GPUs",
             76.8e9),
    "b200": ("DGX B200 datasheet: 2x Intel Xeon Platinum 8570, each 8 channels of DDR5-5600 (Intel ark: 358.4 GB/s a "
             "socket); 716.8 GB/s a node over 8 GPUs", 89.6e9),
    "b300": ("taken as DGX B200's host (2 sockets of 8 DDR5-5600 channels) over 8 GPUs", 89.6e9),
    "gb200": ("GB200 NVL72 datasheet: one Grace CPU per two GPUs, LPDDR5X up to 512 GB/s (18.4 TB/s a rack of 36 "
              "Grace, 72 GPUs)", 256e9),
    "gb300": ("taken as GB200's: one Grace CPU (512 GB/s LPDDR5X) per two GPUs", 256e9),
}
"""The host's peak memory bandwidth per GPU and its source, by preset: the peak the datasheets give (the optimizer's
streaming reads and writes reach a fraction of it; like the other rates, the model takes the peak)."""


@dataclass(frozen=True)
class Gpu:
    """One device's peak rates, per GPU and per direction (bytes/s), as its vendor publishes them.

    The datasheets give tensor-core FLOP/s "with sparsity": the dense rate is half. NVLink and PCIe
    are quoted as the sum of both directions: a collective's send runs at half.
    """

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm: float
    nvlink: float
    ib: float
    pcie: float
    source: str
    domain: int = NODE_GPUS
    """GPUs one NVLink domain joins: a node of 8 (DGX/HGX), 72 for a GB200/GB300 NVL72 rack."""
    host_memory: float = 0.0
    """The host's memory bandwidth per GPU (bytes/s): the CPUs' peak DRAM bandwidth over the GPUs that share them
    (:data:`HOST_MEMORY`); what the optimizer step on the CPU reads and writes at."""

    def peak(self, fp8: bool = False) -> float:
        return self.fp8_flops if fp8 else self.bf16_flops

    def link(self, span: int) -> float:
        """The bandwidth of a group of ``span`` consecutive ranks: NVLink within its domain, else InfiniBand."""
        return self.nvlink if span <= self.domain else self.ib

    def as_dict(self) -> dict:
        return asdict(self)


GPUS: dict[str, Gpu] = {
    # H100 SXM: BF16 1,979 and FP8 3,958 TFLOPS with sparsity; HBM3 3.35 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s.
    "h100": Gpu("h100", bf16_flops=989.5e12, fp8_flops=1979e12, hbm=3.35e12, nvlink=450e9, ib=50e9, pcie=64e9,
                source=f"{H100_SHEET}; {DGX_NETWORK}", host_memory=HOST_MEMORY["h100"][1]),
    # H200 SXM: the same tensor cores as H100 SXM; HBM3e 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s.
    "h200": Gpu("h200", bf16_flops=989.5e12, fp8_flops=1979e12, hbm=4.8e12, nvlink=450e9, ib=50e9, pcie=64e9,
                source=f"{H200_SHEET}; {DGX_NETWORK}", host_memory=HOST_MEMORY["h200"][1]),
    # HGX B200: FP16/BF16 4.5 and FP8 9 PFLOPS with sparsity per GPU; HBM3e 8 TB/s; NVLink 5 1.8 TB/s;
    # PCIe Gen5 x16 128 GB/s to the host.
    "b200": Gpu("b200", bf16_flops=2.25e15, fp8_flops=4.5e15, hbm=8e12, nvlink=900e9, ib=50e9, pcie=64e9,
                source=f"{B200_SHEET}; {DGX_NETWORK}", host_memory=HOST_MEMORY["b200"][1]),
    # HGX B300: FP16/BF16 36 and FP8 72 PFLOPS with sparsity per 8 GPUs (its gain over B200 is FP4); HBM3e
    # 8 TB/s; NVLink 5 1.8 TB/s; host link taken as B200's PCIe Gen5 x16.
    "b300": Gpu("b300", bf16_flops=2.25e15, fp8_flops=4.5e15, hbm=8e12, nvlink=900e9, ib=100e9, pcie=64e9,
                source=f"{B300_SHEET}; {CX8_NETWORK}", host_memory=HOST_MEMORY["b300"][1]),
    # GB200 NVL72: FP16/BF16 360 and FP8 720 PFLOPS with sparsity per 72 GPUs; HBM3e 576 TB/s (8 per GPU); NVLink 5
    # 1.8 TB/s across the rack; NVLink-C2C 900 GB/s to the Grace CPU.
    "gb200": Gpu("gb200", bf16_flops=2.5e15, fp8_flops=5e15, hbm=8e12, nvlink=900e9, ib=50e9, pcie=450e9,
                 source=f"{GB200_SHEET}; {DGX_NETWORK}", host_memory=HOST_MEMORY["gb200"][1], domain=NVL72),
    # GB300 NVL72: FP16/BF16 360 and FP8 720 PFLOPS with sparsity per 72 GPUs (its gain over GB200 is FP4); HBM3e
    # 8 TB/s per GPU; NVLink 5 1.8 TB/s across the rack; NVLink-C2C 900 GB/s to the Grace CPU.
    "gb300": Gpu("gb300", bf16_flops=2.5e15, fp8_flops=5e15, hbm=8e12, nvlink=900e9, ib=100e9, pcie=450e9,
                 source=f"{GB300_SHEET}; {CX8_NETWORK}", host_memory=HOST_MEMORY["gb300"][1], domain=NVL72),
}
"""The presets, each figure from its vendor's public datasheet (the dense rates are half the sparse ones)."""
DEFAULT_GPU = "h100"


class UnknownGpu(ValueError):
    """A ``--gpu`` that is not a preset."""


def gpu(name: str = DEFAULT_GPU, **overrides: Optional[float]) -> Gpu:
    """The preset ``name`` with the given fields (``bf16_flops``, ``hbm``, ``nvlink``, ``ib``...) replaced.

    An override of ``bf16_flops`` scales the FP8 rate with it (the datasheets' ratio, 2), so that one
    ``--gpu-flops`` states one device.
    """
    if name.lower() not in GPUS:  # the presets by any case: H100 as h100
        raise UnknownGpu(f"{name!r} is not a GPU preset ({', '.join(GPUS)})")
    preset = GPUS[name.lower()]
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return preset
    named = ", ".join(sorted(given))
    if "bf16_flops" in given:
        given.setdefault("fp8_flops", given["bf16_flops"] * preset.fp8_flops / preset.bf16_flops)
    return replace(preset, **given, source=f"{preset.source}; overridden: {named}")


@dataclass(frozen=True)
class StepTime:
    """A step's time on one rank in seconds, by term (see the module docstring for each)."""

    compute: float
    tp: float
    dispatch: float
    """The token dispatch and combine of an MoE model's experts (0 for a dense model)."""
    pp_p2p: float
    bubble: float
    dp_exposed: float
    offload_exposed: float
    cp: float = 0.0
    """Context parallelism's ring exchange beyond what the attention core hides."""
    optimizer: float = 0.0
    """The optimizer step on the rank's shard."""

    @property
    def total(self) -> float:
        return (self.compute + self.tp + self.dispatch + self.pp_p2p + self.bubble + self.dp_exposed
                + self.offload_exposed + self.cp + self.optimizer)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def element_size(s: Settings) -> int:
    return 4 if s.dtype == "float32" else 2


def attention_linear_flops(s: Settings) -> int:
    """Forward FLOPs of one layer's attention linears per microbatch on a TP rank: QKV and the output projection
    (multi-latent attention's projections: :func:`latent_attention_linear_flops`)."""
    if s.mla is not None:
        return latent_attention_linear_flops(s)
    tokens = s.seq_length * s.micro_batch
    q, kv = s.heads * s.kv_channels, 2 * s.query_groups * s.kv_channels
    return (2 * tokens * s.hidden * (q + kv) + 2 * tokens * q * s.hidden) // s.tp


def latent_attention_linear_flops(s: Settings) -> int:
    """Forward FLOPs of one multi-latent attention layer's linears per microbatch on a TP rank: the down projections
    (h -> q_lora_rank, h -> kv_lora_rank + qk_pos_emb_head_dim), the up projections
    (:func:`.recompute.cost.mla_up_projection_flops`) and the output projection. Transformer Engine's down
    projections hold the whole weight on every rank and take the rank's own tokens, its sequence shard under SP and
    every token without it; the local spec's are column-parallel on the gathered sequence."""
    from megatron_bridge_ext.levers.recompute.cost import mla_up_projection_flops

    m, tokens = s.mla, s.seq_length * s.micro_batch
    down = 2 * tokens * s.hidden * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_pos_emb_head_dim)
    split = s.tp if s.sequence_parallel or s.transformer_impl != "transformer_engine" else 1
    proj = 2 * tokens * s.heads * m.v_head_dim * s.hidden // s.tp
    return down // split + mla_up_projection_flops(s) + proj


def mamba_linear_flops(s: Settings) -> int:
    """Forward FLOPs of one Mamba mixer's projections per microbatch on a TP rank (``s.hybrid.mamba``: the whole
    mixer's sizes): ``in_proj`` h -> 2 d_inner + 2 groups state + heads and ``out_proj`` d_inner -> h, on the whole
    sequence (``in_proj`` gathers it under SP)."""
    m, tokens = s.hybrid.mamba, s.seq_length * s.micro_batch
    return (2 * tokens * s.hidden * m.in_proj + 2 * tokens * m.inner * s.hidden) // s.tp


def mamba_scan_flops(s: Settings) -> int:
    """Forward FLOPs of one Mamba-2 chunked scan (SSD) per microbatch on a TP rank, its matrix products over chunks of
    L tokens: C B^T per group (2 L state per token and group), the masked product with x per head (2 L head_dim), the
    chunk states B^T x and their read-out C h per head (2 x 2 state head_dim per token). Its convolution and
    elementwise steps are left out, as the other elementwise kernels are."""
    m, tokens, tp = s.hybrid.mamba, s.seq_length * s.micro_batch, s.tp
    heads, groups, chunk = m.heads // tp, m.groups // tp, m.chunk
    per_token = 2 * chunk * m.state * groups + 2 * chunk * m.head_dim * heads + 4 * m.state * m.head_dim * heads
    return tokens * per_token


def linear_forward_flops(s: Settings, moe: Optional[dict] = None) -> int:
    """Forward FLOPs of the stage's linears per microbatch on a rank: attention on its layers (every GPT layer), the
    dense MLP on dense layers, the router, routed and shared experts on MoE layers
    (:func:`.recompute.cost.moe_layer_flops`), a hybrid model's Mamba projections on its Mamba layers."""
    from megatron_bridge_ext.levers.parallelism.cost import layer_counts
    from megatron_bridge_ext.levers.recompute.cost import moe_layer_flops, recompute_flops_per_layer

    counts = layer_counts(s, moe)
    return (counts.attention * attention_linear_flops(s) + counts.mlp * recompute_flops_per_layer("mlp", s)
            + (counts.moe * moe_layer_flops(s, moe) if counts.moe else 0)
            + (counts.mamba * mamba_linear_flops(s) if counts.mamba else 0))


def attention_core_flops(s: Settings) -> int:
    """Forward FLOPs of one layer's attention core per microbatch on a TP rank (full s x s)."""
    from megatron_bridge_ext.levers.recompute.cost import recompute_flops_per_layer

    return recompute_flops_per_layer("core_attn", s)


def output_layer_flops(s: Settings) -> int:
    """Forward FLOPs of the output layer per microbatch on the last stage's TP rank (none elsewhere)."""
    if s.stage != s.pp - 1:
        return 0
    return 2 * s.seq_length * s.micro_batch * s.hidden * s.vocab_size // s.tp


def recompute_hbm_bytes(s: Settings) -> int:
    """HBM bytes one microbatch's layernorm recompute reads and writes ([s/t, b, h] under SP per norm: two per GPT
    layer; one per attention, MLP or MoE layer of a hybrid model, none on its Mamba layers)."""
    if s.recompute_granularity != "selective" or "layernorm" not in s.recompute_modules:
        return 0
    seq = s.seq_length // s.tp if s.sequence_parallel else s.seq_length
    from megatron_bridge_ext.levers.parallelism.cost import layer_counts

    norms = (s.layers_on_stage - layer_counts(s, None).mamba if s.hybrid is not None
             else 2 * s.layers_on_stage)
    return 2 * seq * s.micro_batch * s.hidden * element_size(s) * norms


def tp_bytes(s: Settings, moe: Optional[dict] = None) -> int:
    """Bytes a rank sends per microbatch for TP: the layers' activations (attention's half only on MoE layers, and
    the shared experts') and the LoRA-A inputs' collectives."""
    from megatron_bridge_ext.levers.lora_input.cost import collective_elements
    from megatron_bridge_ext.levers.parallelism.cost import stage_layer_kinds, tp_collective_bytes

    t = s.tp
    if t == 1:
        return 0
    layers = tp_collective_bytes(s, tp=t, layers=s.layers_on_stage, num_microbatches=1, element=element_size(s),
                                 moe_layers=stage_layer_kinds(s, moe)[1],
                                 shared_experts=bool(moe and moe["shared_ffn"]))
    lora = 0
    if s.peft is not None and s.sequence_parallel:
        strategy = s.peft.sequence_parallel_input_strategy
        lora = collective_elements(s, strategy, stage=s.stage) * element_size(s) * (t - 1) // t
    return layers + lora


def trainable_params(s: Settings, moe: Optional[dict] = None) -> int:
    """Trainable dense parameters on this rank: the stage's layers (and embedding/output) under full fine-tuning,
    the adapters under LoRA (r x (in + out) per targeted linear, divided over TP). MoE layers count their
    attention here; their experts go over the expert-DP group (:func:`dp_bytes`). A hybrid model's layers count
    the linears of their kind (attention, MLP, Mamba projections)."""
    from megatron_bridge_ext.levers.parallelism.cost import layer_counts

    h, ffn, t = s.hidden, s.ffn * (2 if s.gated_linear_unit else 1), s.tp
    q, kv = s.heads * s.kv_channels, 2 * s.query_groups * s.kv_channels
    attention = {"linear_qkv": (h, q + kv), "linear_proj": (q, h)} if s.mla is None else _latent_linears(s)
    mlp = {"linear_fc1": (h, ffn), "linear_fc2": (s.ffn, h)}
    mamba = {}
    if s.hybrid is not None and s.hybrid.mamba is not None:
        m = s.hybrid.mamba
        mamba = {"in_proj": (h, m.in_proj), "out_proj": (m.inner, h)}
    counts = layer_counts(s, moe)
    if s.hybrid is not None:  # a layer holds one part; an MoE layer's experts go over expert DP
        parts = [(attention, counts.attention), (mlp, counts.mlp), (mamba, counts.mamba)]
    else:  # every layer attention; MLP linears on dense layers under full fine-tuning, as adapted on every layer
        parts = [(attention, counts.attention), (mlp, counts.mlp if s.peft is None else s.layers_on_stage)]
    if s.peft is not None:
        targets = set(s.peft.lora_targets)
        return sum(s.peft.lora_dim * sum(sum(shape) for name, shape in shapes.items() if name in targets) * n
                   for shapes, n in parts) // t
    ends = (s.stage == 0) + (s.stage == s.pp - 1)  # embedding on the first stage, output on the last
    sharded = sum(sum(i * o for i, o in shapes.values()) * n for shapes, n in parts) + ends * s.vocab_size * h
    whole = _duplicated_parameters(s) * counts.attention  # Transformer Engine's duplicated down projections
    return (sharded - whole) // t + whole


def _latent_linears(s: Settings) -> dict[str, tuple[int, int]]:
    """Multi-latent attention's linears as (input, output) sizes of the whole layer (before TP)."""
    m, h = s.mla, s.hidden
    query = ({"linear_q_proj": (h, s.heads * m.q_head_dim)} if m.q_lora_rank is None else
             {"linear_q_down_proj": (h, m.q_lora_rank), "linear_q_up_proj": (m.q_lora_rank, s.heads * m.q_head_dim)})
    return {**query, "linear_kv_down_proj": (h, m.kv_lora_rank + m.qk_pos_emb_head_dim),
            "linear_kv_up_proj": (m.kv_lora_rank, s.heads * (m.qk_head_dim + m.v_head_dim)),
            "linear_proj": (s.heads * m.v_head_dim, h)}


def _duplicated_parameters(s: Settings) -> int:
    """Parameters of a layer's down projections that Transformer Engine keeps whole on every TP rank (multi-latent
    attention under full fine-tuning; adapters never target them here)."""
    if s.mla is None or s.transformer_impl != "transformer_engine" or s.peft is not None:
        return 0
    return s.hidden * ((s.mla.q_lora_rank or 0) + s.mla.kv_lora_rank + s.mla.qk_pos_emb_head_dim)


def dp_bytes(s: Settings, moe: Optional[dict] = None) -> int:
    """Bytes a rank sends per step for the gradients and parameters of data parallelism (and, for an MoE model,
    the expert weights' over the expert-DP group: :func:`.parallelism.cost.expert_dp_bytes`)."""
    from megatron_bridge_ext.levers.parallelism.cost import expert_dp_bytes, stage_layer_kinds

    dp = s.dp * s.cp
    experts = 0
    if moe:
        experts = expert_dp_bytes(s, moe, ep=moe["ep"], etp=moe["etp"], moe_layers=stage_layer_kinds(s, moe)[1],
                                  element=element_size(s))
    if dp == 1:
        return experts
    per_param = fsdp_bytes_per_parameter(s) if s.fsdp else \
        GRAD_BYTES + PARAM_GATHER_BYTES if s.distributed_optimizer else 2 * GRAD_BYTES
    return per_param * trainable_params(s, moe) * (dp - 1) // dp + experts


def fsdp_bytes_per_parameter(s: Settings) -> int:
    """Bytes per parameter Megatron-FSDP sends in a step, by strategy: with sharded gradients each microbatch's
    backward reduce-scatters them (``megatron_fsdp.py`` L755-770, ``grad_reduce_every_bprop``) in the parameter dtype
    (``megatron_fsdp_main_grads_dtype`` unset); under ``optim_grads_params`` each microbatch also all-gathers every
    layer's parameters for its forward and again for its backward (L780-800, L897-913); else the step all-gathers
    the updated parameters once (``no_shard`` all-reduces the gradients once instead)."""
    p = element_size(s)
    m = s.num_microbatches
    return {"no_shard": 2 * p, "optim": 2 * p, "optim_grads": m * p + p, "optim_grads_params": m * 3 * p}[s.fsdp]


def dispatch_bytes(s: Settings, moe: Optional[dict]) -> int:
    """Bytes a rank sends per microbatch to dispatch tokens to the experts and combine them, forward and backward
    (and once more forward under ``moe`` recompute): :func:`.parallelism.cost.dispatch_bytes_per_layer`."""
    from megatron_bridge_ext.levers.parallelism.cost import dispatch_bytes_per_layer, stage_layer_kinds
    from megatron_bridge_ext.levers.recompute.cost import recompute_dispatch_bytes

    if not moe:
        return 0
    per_layer = dispatch_bytes_per_layer(s, moe, ep=moe["ep"], etp=moe["etp"], element=element_size(s))
    modules = s.recompute_modules if s.recompute_granularity == "selective" else []
    once = replace(s, num_microbatches=1)
    return per_layer * stage_layer_kinds(s, moe)[1] + recompute_dispatch_bytes(once, modules, moe, element_size(s))


def p2p_bytes(s: Settings) -> int:
    """Bytes a stage sends per microbatch to its pipeline neighbours."""
    from megatron_bridge_ext.levers.parallelism.cost import p2p_bytes as per_step

    return per_step(s, pp=s.pp, tp=s.tp, num_microbatches=1, element=element_size(s))


CAUSAL_CORE = 0.5
"""The share of the s x s attention core a causal kernel computes: cuDNN's and flash attention's fused kernels skip
the blocks above the diagonal (Bridge's flop_utils.py counts the same half: ``core_attn_seq_factor / 2``)."""
OPTIMIZER_BYTES = 30
"""HBM bytes Adam moves per parameter of the rank's shard: fp32 master weight, gradient, two moments read (16), the
weight and moments written (12), the bf16 weight written (2)."""


def _gemm_seconds(flops: float, per_gemm: float, device: Gpu, fp8: bool) -> float:
    """Seconds for ``flops`` FLOPs of GEMMs of ``per_gemm`` FLOPs each (:func:`.calibration.gemm_efficiency`)."""
    return flops / (device.peak(fp8) * calibration.gemm_efficiency(max(per_gemm, 1.0), fp8)) if flops else 0.0


def _layer_linears(s: Settings, moe: Optional[dict]) -> list[tuple[int, int, int]]:
    """The stage's linears per microbatch on a rank as (layers, forward FLOPs per layer, GEMMs per layer): attention
    (QKV and projection; multi-latent attention's five), the dense MLP (fc1, fc2), the MoE layer (fc1 and fc2 per
    local expert), the Mamba projections (in, out)."""
    from megatron_bridge_ext.levers.parallelism.cost import layer_counts
    from megatron_bridge_ext.levers.recompute.cost import moe_layer_flops, recompute_flops_per_layer

    counts = layer_counts(s, moe)
    kinds = [(counts.attention, attention_linear_flops(s), 2 if s.mla is None else 5),
             (counts.mlp, recompute_flops_per_layer("mlp", s), 2)]
    if counts.moe:
        kinds.append((counts.moe, moe_layer_flops(s, moe), 2 * max(1, moe["experts"] // moe["ep"])))
    if counts.mamba:
        kinds.append((counts.mamba, mamba_linear_flops(s), 2))
    return kinds


def linear_seconds_per_flop(s: Settings, device: Gpu, moe: Optional[dict] = None) -> float:
    """Seconds per FLOP of the stage's linears, each at the efficiency of its GEMM's per-GPU size (the sequence on a
    rank is its CP share), in FP8 when the config trains in FP8."""
    fp8, flops, seconds = bool(s.fp8), 0, 0.0
    for layers, per_layer, gemms in _layer_linears(s, moe):
        flops += layers * per_layer
        seconds += _gemm_seconds(layers * per_layer, per_layer / gemms / s.cp, device, fp8)
    return seconds / flops if flops else 0.0


def core_seconds_per_flop(device: Gpu) -> float:
    """Seconds per FLOP of the attention core and the Mamba scans: fused kernels in BF16 (Bridge's FP8 recipes keep
    the core in BF16) at a large GEMM's fraction of the BF16 peak."""
    return 1.0 / (device.bf16_flops * calibration.GEMM_PEAK_FRACTION_BF16)


@dataclass(frozen=True)
class MicrobatchWork:
    """The forward FLOPs one microbatch runs on this rank, by what times them (before the CP split): the linears,
    the attention cores (at their computed causal half, :data:`CAUSAL_CORE`) and Mamba scans, each selective
    recompute module (its FLOPs per layer, its layers), the output layer; ``passes`` of the linears and the output layer (3, or 2 for
    frozen linears under PEFT: no weight gradient)."""

    passes: int
    linears: int
    core: float
    recomputed: tuple[tuple[str, int, int], ...]
    output: int
    full_recompute: bool


def microbatch_work(s: Settings, moe: Optional[dict] = None) -> MicrobatchWork:
    """What one microbatch runs on this rank (:class:`MicrobatchWork`), for its FLOPs and for its seconds."""
    from megatron_bridge_ext.levers.parallelism.cost import layer_counts
    from megatron_bridge_ext.levers.recompute.cost import layers_for, recompute_flops_per_layer

    counts = layer_counts(s, moe)
    core = counts.attention * attention_core_flops(s) * CAUSAL_CORE + (
        counts.mamba * mamba_scan_flops(s) if counts.mamba else 0)
    selective = s.recompute_modules if s.recompute_granularity == "selective" else ()
    return MicrobatchWork(passes=2 if s.peft is not None else 3, linears=linear_forward_flops(s, moe), core=core,
                          recomputed=tuple((m, recompute_flops_per_layer(m, s, moe), layers_for(m, s, moe))
                                           for m in selective),
                          output=output_layer_flops(s), full_recompute=s.recompute_granularity == "full")


def microbatch_flops(s: Settings, moe: Optional[dict] = None) -> float:
    """FLOPs one microbatch runs on this rank, as :func:`microbatch_seconds` times them: forward, backward,
    recompute (:class:`MicrobatchWork`)."""
    w = microbatch_work(s, moe)
    total = w.passes * w.linears + 3 * w.core + w.passes * w.output
    if w.full_recompute:
        total += w.linears + w.core
    total += sum(flops * layers * (CAUSAL_CORE if m == "core_attn" else 1) for m, flops, layers in w.recomputed)
    return total / s.cp


def microbatch_seconds(s: Settings, device: Gpu, moe: Optional[dict] = None) -> tuple[float, float, float]:
    """(compute, linears, attention core) seconds of one microbatch on this rank: the work of
    :func:`microbatch_work`, the linears at :func:`linear_seconds_per_flop`, the causal core at
    :func:`core_seconds_per_flop`, each recompute module at its own rate, the output layer (BF16) at its own GEMM's
    efficiency, layernorm recompute at HBM bandwidth."""
    w = microbatch_work(s, moe)
    linears = w.linears * linear_seconds_per_flop(s, device, moe)
    core = w.core * core_seconds_per_flop(device)
    total = w.passes * linears + 3 * core
    if w.full_recompute:
        total += linears + core
    total += sum(_recompute_seconds(m, flops, s, device, moe) * layers for m, flops, layers in w.recomputed)
    total += w.passes * _gemm_seconds(w.output, w.output / s.cp, device, False)
    cp = s.cp
    return total / cp + recompute_hbm_bytes(s) / device.hbm, w.passes * linears / cp, 3 * core / cp


RECOMPUTE_GEMMS = {"mlp": 2, "shared_experts": 2, "mla_up_proj": 2}
"""GEMMs per layer of the recomputed modules with linears (an MoE layer's: two per local expert)."""


def _recompute_seconds(module: str, flops: int, s: Settings, device: Gpu, moe: Optional[dict]) -> float:
    """One layer's recompute of ``module`` (``flops``: its forward FLOPs per layer) per microbatch: the causal core at
    the core's rate, linears at their own GEMMs' efficiency, elementwise modules none (layernorm's HBM traffic:
    :func:`recompute_hbm_bytes`)."""
    if module == "core_attn":
        return flops * CAUSAL_CORE * core_seconds_per_flop(device)
    gemms = 2 * max(1, moe["experts"] // moe["ep"]) if module == "moe" and moe else RECOMPUTE_GEMMS.get(module, 1)
    return _gemm_seconds(flops, flops / gemms / s.cp, device, bool(s.fp8))


def cp_bytes(s: Settings) -> int:
    """Bytes a rank sends per microbatch for context parallelism's ring attention: each layer passes its K and V
    chunk (s/cp tokens, its TP share of the key-value heads) around the ring, cp - 1 hops, forward; the backward
    passes them again with their gradients (twice the forward)."""
    if s.cp == 1:
        return 0
    from megatron_bridge_ext.levers.parallelism.cost import layer_counts

    kv = 2 * (s.query_groups * s.kv_channels if s.mla is None else s.heads * (s.mla.q_head_dim + s.mla.v_head_dim))
    per_layer = (s.cp - 1) * (s.seq_length // s.cp) * s.micro_batch * max(kv // s.tp, 1) * element_size(s)
    return 3 * per_layer * layer_counts(s, None).attention


def optimizer_seconds(s: Settings, device: Gpu, moe: Optional[dict] = None) -> float:
    """Adam's step on the rank's shard (the distributed optimizer divides the dense parameters over DP x CP and the
    experts' over expert DP): :data:`OPTIMIZER_BYTES` per parameter at HBM bandwidth, less what 16-bit moments save
    (read and written at ``moment_bytes`` instead of 8: the precision-aware optimizer's)."""
    from megatron_bridge_ext.levers.parallelism.cost import (expert_dp_size, expert_parameters_per_rank,
                                                             stage_layer_kinds)

    shard = s.dp * s.cp if s.distributed_optimizer else 1
    params = trainable_params(s, moe) / shard
    if moe and s.peft is None:
        experts = expert_parameters_per_rank(s, moe, ep=moe["ep"], etp=moe["etp"],
                                             moe_layers=stage_layer_kinds(s, moe)[1])
        params += experts / (max(1, expert_dp_size(s, ep=moe["ep"], etp=moe["etp"])) if s.distributed_optimizer else 1)
    seconds = (OPTIMIZER_BYTES - 2 * (8 - s.moment_bytes)) * params / device.hbm
    if s.optimizer_offload is None:
        return seconds
    return host_optimizer_seconds(params, s.optimizer_offload, seconds, device, overlap=s.optimizer_offload_overlap)


HOST_ADAM_BYTES = 28
"""Host memory bytes torch's fused AdamW (Core's ``CPUAdam``, ``optimizer/__init__.py`` L11, L515-531) moves per
offloaded element: the fp32 parameter, gradient and two moments read (16), the parameter and moments written (12)."""
HOST_LINK_BYTES = 4
"""Bytes per offloaded element each way over the host link: the fp32 gradient of the distributed optimizer's main
shard down (``hybrid_optimizer.py`` L98-114) and the updated fp32 parameter back up (L117-125)."""


def host_optimizer_seconds(params: float, share: float, gpu_seconds: float, device: Gpu, *, overlap: bool) -> float:
    """The optimizer step with ``share`` of the rank's ``params`` shard elements on the host (Core's
    ``HybridDeviceOptimizer``); ``gpu_seconds``: the whole shard's step on the GPU, of which the rest steps there.

    The gradients go down (:data:`HOST_LINK_BYTES` each, ``device.pcie``, one direction), the host steps them at
    ``device.host_memory`` (:data:`HOST_ADAM_BYTES`), the parameters come back up; the GPU's step runs meanwhile (its
    kernels are queued before the host waits for its copies, ``hybrid_optimizer.py`` L162-174). Without
    ``overlap_cpu_optimizer_d2h_h2d`` the copies run on the compute stream and one host optimizer steps everything
    (L208-218): down, then the slower of the two steps, then up. With it, side streams and one host optimizer per
    parameter (L204-207, L219-221) pipeline them parameter by parameter: the slowest of the four."""
    host = share * params
    down = up = HOST_LINK_BYTES * host / device.pcie
    cpu = HOST_ADAM_BYTES * host / device.host_memory
    gpu = (1.0 - share) * gpu_seconds
    return max(down, cpu, gpu, up) if overlap else down + max(cpu, gpu) + up


def tp_exposed(s: Settings, tp_seconds: float, linear_seconds: float) -> float:
    """The TP collectives' exposed seconds per microbatch: all of them, unless the config runs ``tp_comm_overlap``
    (Bridge keeps it only with TP > 1 and sequence parallelism: comm_overlap.py L442-451; Bridge's performance
    recipes turn it on); then only what the linears' time cannot cover."""
    if not (s.tp_comm_overlap and s.sequence_parallel and s.tp > 1):
        return tp_seconds
    return max(0.0, tp_seconds - linear_seconds)


def step_time(s: Settings, device: Gpu, *, offload_bytes: int = 0, moe: Optional[dict] = None) -> StepTime:
    """The step time of the config whose estimate settings are ``s`` (``offload_bytes``: to the host and
    back per step under CPU offloading; ``moe``: :func:`.parallelism.cost.moe_shape` of an MoE model), on
    the last pipeline stage: with the output layer it is the slowest, and it paces the pipeline (its
    layers are the estimate's stage's: stages hold equal layers)."""
    s = replace(s, stage=s.pp - 1)
    m, pp, vpp, cp = s.num_microbatches, s.pp, s.vpp or 1, s.cp
    tp_span, dp_span = s.tp, s.tp * cp * s.dp
    compute_mb, linear_mb, core_mb = microbatch_seconds(s, device, moe)
    tp_mb = tp_exposed(s, tp_bytes(s, moe) / device.link(tp_span), linear_mb)
    cp_mb = max(0.0, cp_bytes(s) / device.link(tp_span * cp) - core_mb)  # the ring's P2P runs under the core
    dispatch_mb = dispatch_bytes(s, moe) / device.link(moe["ep"] * moe["etp"]) if moe else 0.0  # ETP inner, then EP
    p2p_mb = 0.0 if vpp > 1 else p2p_bytes(s) / device.link(dp_span * pp)  # overlap_p2p_comm with VPP: L453-457
    compute = m * compute_mb
    offload = offload_bytes / device.pcie
    return StepTime(compute=compute, tp=m * tp_mb, dispatch=m * dispatch_mb, pp_p2p=m * p2p_mb,
                    bubble=(pp - 1) / vpp * (compute_mb + tp_mb + cp_mb + dispatch_mb),
                    dp_exposed=max(0.0, dp_bytes(s, moe) / device.link(dp_span) - compute),
                    offload_exposed=max(offload - compute, offload / s.layers_on_stage) if offload_bytes else 0.0,
                    cp=m * cp_mb, optimizer=optimizer_seconds(s, device, moe))


def change_pct(before: StepTime, after: StepTime) -> float:
    """The step-time change from ``before`` to ``after`` in percent (positive: slower)."""
    return 100.0 * (after.total / before.total - 1.0)
