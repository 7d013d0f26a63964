"""Settings that do not go with expandable segments, each checked before launch.

Every check returns :class:`~megatron_bridge_ext.findings.Finding` objects that name the setting
and the fix. ``error`` findings stop the setup (a run that would fail later, or misbehave, is
refused before it starts); ``warning`` findings are logged and returned; ``action`` findings say
what was set because expandable segments require it.
"""

from __future__ import annotations

from typing import Optional

from megatron_bridge_ext.levers.allocator.options import AllocConf
from megatron_bridge_ext.evidence import COST_WITHOUT_EXPANDABLE
from megatron_bridge_ext.findings import ACTION, ERROR, WARNING, Finding

NCCL_GRAPH_REGISTER = "NCCL_GRAPH_REGISTER"
IPC_ENV = "MBX_ALLOCATOR_IPC"
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
"""Megatron Core's ``TransformerConfig.cuda_graph_impl`` values (0.17-0.19)."""


def check_cuda_graph_impl(value: Optional[str]) -> None:
    """Refuse a ``cuda_graph_impl`` Megatron Core does not know: a misspelling would skip the CUDA-graph guard."""
    if value is not None and value not in CUDA_GRAPH_IMPLS:
        raise ValueError(f"cuda_graph_impl={value!r} is not one of Megatron Core's {', '.join(CUDA_GRAPH_IMPLS)}. "
                         "Fix: give one of them (the training config's model.cuda_graph_impl), or None")


def user_disabled(variable: str) -> Finding:
    return Finding("user_disabled", WARNING, f"{variable} expandable_segments:False",
                   f"kept as you set it; {COST_WITHOUT_EXPANDABLE}.",
                   "drop expandable_segments:False unless the job needs it off: NCCL user buffers (ddp.nccl_ub) on "
                   "torch < 2.11, or processes sharing CUDA memory through IPC (docs/levers/allocator.md, Guards)")


def nccl_ub(torch_version: tuple[int, int], user_set: bool) -> Optional[Finding]:
    """Megatron Core raises at DDP config time for nccl_ub + expandable segments on torch < 2.11."""
    if torch_version >= (2, 11):
        return None
    how = "you set expandable_segments:True" if user_set else "megatron_bridge_ext turns on expandable_segments"
    return Finding(
        "nccl_ub", ERROR, "ddp.nccl_ub (DistributedDataParallelConfig.nccl_ub)",
        f"NCCL user-buffer registration does not work with expandable segments on torch "
        f"{torch_version[0]}.{torch_version[1]} < 2.11 (torch.cuda.MemPool), and {how}; Megatron Core "
        "would raise ValueError when the DDP config is built.",
        "choose one: ddp.nccl_ub=False and keep expandable segments (no fragmentation, no NCCL "
        "user buffers), or keep nccl_ub and set expandable_segments:False explicitly in "
        "PYTORCH_ALLOC_CONF (fragmentation risk), or upgrade to torch >= 2.11",
    )


def cuda_graphs(cuda_graph_impl: str, current: Optional[str]) -> tuple[Optional[str], Optional[Finding]]:
    """CUDA graphs + expandable segments need NCCL_GRAPH_REGISTER=0 (else illegal memory access).

    Returns the value to set (``"0"`` when absent) and a finding.
    """
    if current is None:
        return "0", Finding("cuda_graphs", ACTION, NCCL_GRAPH_REGISTER,
                            f"set to 0: cuda_graph_impl={cuda_graph_impl!r} with expandable segments needs NCCL "
                            "graph registration off (NCCL registering expandable-segment memory in a graph "
                            "leads to illegal memory access).")
    if current.strip() == "0":
        return None, None
    return None, Finding(
        "cuda_graphs", ERROR, NCCL_GRAPH_REGISTER,
        f"is {current!r}, but cuda_graph_impl={cuda_graph_impl!r} with expandable segments needs "
        "NCCL_GRAPH_REGISTER=0 (graph registration of expandable-segment memory leads to illegal memory access).",
        "unset NCCL_GRAPH_REGISTER or set it to 0, or set expandable_segments:False, or cuda_graph_impl='none'",
    )


def cuda_malloc_async(variable: str, user_expandable: Optional[bool]) -> Finding:
    """backend:cudaMallocAsync replaces the caching allocator; expandable_segments means nothing to it."""
    if user_expandable:
        return Finding(
            "cuda_malloc_async", ERROR, f"{variable} backend:cudaMallocAsync",
            "together with expandable_segments:True: cudaMallocAsync is CUDA's own pool allocator and ignores "
            "expandable_segments, so the setting would look on while it is not.",
            "choose one: remove backend:cudaMallocAsync (native allocator with expandable segments), "
            "or remove expandable_segments:True",
        )
    return Finding(
        "cuda_malloc_async", WARNING, f"{variable} backend:cudaMallocAsync",
        "ignores expandable_segments, so it was not added; fragmentation is then up to CUDA's pool allocator.",
        "remove backend:cudaMallocAsync to use the native allocator with expandable segments",
    )


def max_split_size(variable: str, conf: AllocConf) -> Optional[Finding]:
    value = conf.get("max_split_size_mb")
    if value is None:
        return None
    return Finding(
        "max_split_size", WARNING, f"{variable} max_split_size_mb:{value}",
        "together with expandable segments lets reserved memory grow without bound.",
        "remove max_split_size_mb (expandable segments already address fragmentation)",
    )


def ipc(variable: str, user_expandable: Optional[bool]) -> Finding:
    """Memory shared between processes through CUDA IPC cannot live in expandable segments."""
    fix = (f"keep expandable segments off in the processes that share CUDA memory ({IPC_ENV}=1 or "
           "ipc=True there), on in the others")
    if user_expandable:
        return Finding(
            "ipc", WARNING, f"{IPC_ENV} / ipc=True",
            f"this process shares CUDA memory through IPC (colocated inference, weight sync) but {variable} has "
            "expandable_segments:True: sharing an expandable-segment tensor fails (torch 2.14.1 only allows it "
            "with TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=1 and a kernel with pidfd_getfd).", fix)
    return Finding(
        "ipc", WARNING, f"{IPC_ENV} / ipc=True",
        "this process shares CUDA memory through IPC (colocated inference, weight sync), so expandable "
        f"segments were not turned on; {COST_WITHOUT_EXPANDABLE}.", fix)


def conf_findings(variable: str, conf: AllocConf) -> list[Finding]:
    """Keys torch will reject or override: reported, never dropped."""
    findings = []
    for key in conf.unknown_keys():
        findings.append(Finding(
            "unknown_key", ERROR, f"{variable} {key}",
            "is not a key torch knows (checked against torch 2.14.1's allocator config); torch raises "
            "'ValueError: Unrecognized key' when it first reads the settings, i.e. after launch.",
            f"check the spelling of {key!r} or remove it"))
    for key in conf.duplicates():
        findings.append(Finding(
            "duplicate_key", WARNING, f"{variable} {key}",
            f"appears more than once; torch applies the last one ({key}:{_render(conf.get(key))}).",
            f"keep one {key} entry"))
    return findings


def mirrored(source: str, target: str) -> Finding:
    """Torch >= 2.12 reads PYTORCH_CUDA_ALLOC_CONF first: the user's PYTORCH_ALLOC_CONF options go there too."""
    return Finding(
        "mirrored", ACTION, target,
        f"set to the same options as {source}: torch reads {target} first when it is set, and a later "
        f"{target} (e.g. from a Bridge recipe's env_vars, which Bridge applies with os.environ.setdefault) would "
        f"otherwise hide your {source} options.")


def carried(source: str, target: str) -> Finding:
    """The recipe's variable shadows the user's shell variable: the user's options go into the recipe's."""
    return Finding(
        "carried", ACTION, f"cfg.env_vars {target}",
        f"now also holds your shell's {source} options: Bridge applies cfg.env_vars with os.environ.setdefault, "
        f"so {target} from the recipe would be set, and torch reads {target} first and would ignore your {source}.")


def shadowed(variable: str, value: str, winner: str, winner_set: bool) -> Finding:
    reason = (f"{winner} is set (even an empty value hides it)" if winner_set
              else f"this torch reads only {winner}")
    return Finding(
        "shadowed", WARNING, variable,
        f"{value!r} is ignored by this torch because {reason}; left as it is.",
        f"move its options into {winner}" + (f", or unset {winner}" if winner_set else ""))


def _render(value) -> str:
    return "[" + ",".join(value) + "]" if isinstance(value, tuple) else str(value)
