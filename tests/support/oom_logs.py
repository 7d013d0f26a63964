"""Training-log lines as upstream prints them, for the `mbx diagnose` tests. Each builder names its source.

Nothing here parses: the tests feed these lines to the readers and compare the records with the
figures the builders were given.
"""

from __future__ import annotations

import math

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10


def format_size(size: int) -> str:
    """c10's ``format_size`` (c10/cuda/CUDACachingAllocator.cpp, torch 2.0-2.14): ``N bytes`` up to 1 KiB,
    then two decimals of KiB, MiB or GiB."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576:.2f} MiB"
    return f"{size / 1073741824:.2f} GiB"


def allocator_oom(request: int, *, total: int, free: int, allocated: int, reserved: int, private: int = 0,
                  allowed: int | None = None, processes=(), this_process: int | None = None, device: int = 0,
                  wording: str = "current") -> str:
    """The caching allocator's OOM message (``DeviceCachingAllocator::malloc``), as ``str(torch.OutOfMemoryError)``.

    ``allocated``/``reserved`` are ``allocated_bytes``/``reserved_bytes`` ``.all.current``; ``private`` the free
    blocks of private pools. ``wording``: "current" (torch >= 2.3, private-pool clause when nonzero; pytorch
    c10/cuda/CUDACachingAllocator.cpp, the TORCH_CHECK_WITH(OutOfMemoryError, ...) after ``reportProcessMemoryInfo``),
    "2.1" (no private-pool clause, "capacty"), "2.0" (the parenthesised form of v2.0.0).
    """
    allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
    if wording == "2.0":
        return (f"CUDA out of memory. Tried to allocate {format_size(request)} (GPU {device}; {format_size(total)} total "
                f"capacity; {format_size(allocated)} already allocated; {format_size(free)} free; {allowed_info}"
                f"{format_size(reserved)} reserved in total by PyTorch) If reserved memory is >> allocated memory try "
                "setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and "
                "PYTORCH_CUDA_ALLOC_CONF")
    proc_info = "".join(f"Process {pid} has {format_size(size)} memory in use. " for pid, size in processes)
    if this_process is not None:
        proc_info += f"Including non-PyTorch memory, this process has {format_size(this_process)} memory in use. "
    capacity = "capacty" if wording == "2.1" else "capacity"
    pools = f"with {format_size(private)} allocated in private pools (e.g., CUDA Graphs), " if private and \
        wording == "current" else ""
    return (f"CUDA out of memory. Tried to allocate {format_size(request)}. GPU {device} has a total {capacity} of "
            f"{format_size(total)} of which {format_size(free)} is free. {proc_info}{allowed_info}Of the allocated "
            f"memory {format_size(allocated + private)} is allocated by PyTorch, {pools}and "
            f"{format_size(reserved - allocated - private)} is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def traceback(message: str) -> list[str]:
    """The last lines of a rank's traceback for an OOM raised in a training step."""
    return ["Traceback (most recent call last):", '  File "pretrain.py", line 10, in <module>',
            "    finetune(cfg, forward_step)", f"torch.OutOfMemoryError: {message}"]


BRIDGE_KEYS = (  # megatron/bridge/training/utils/train_utils.py MEMORY_KEYS (Bridge 0.6.2, L258-269)
    ("allocated_bytes.all.current", "mem-allocated-bytes"), ("active_bytes.all.current", "mem-active-bytes"),
    ("inactive_split_bytes.all.current", "mem-inactive-bytes"), ("reserved_bytes.all.current", "mem-reserved-bytes"),
    ("allocated_bytes.all.peak", "mem-max-allocated-bytes"), ("active_bytes.all.peak", "mem-max-active-bytes"),
    ("inactive_split_bytes.all.peak", "mem-max-inactive-bytes"), ("reserved_bytes.all.peak", "mem-max-reserved-bytes"),
    ("num_alloc_retries", "mem-alloc-retires"), ("allocation.all.current", "mem-allocated-count"),
)


def bridge_gigabytes(nbytes: int):
    """``report_memory``'s figure: bytes / 1e9 rounded to 5 significant digits (train_utils.py L1288-1294)."""
    gigabytes = nbytes / 1.0e9
    if gigabytes != 0:
        gigabytes = round(gigabytes, -int(math.floor(math.log10(abs(gigabytes)))) + 4)
    return gigabytes


def bridge_memory_line(rank: int, iteration: int, stats: dict) -> str:
    """Bridge's report (``training_log``, train_utils.py L1231-1235): ``[Rank r] (after i iterations) memory (GB) | ...``."""
    line = f"(after {iteration} iterations) memory (GB)"
    for torch_name, name in BRIDGE_KEYS:
        if torch_name in stats:
            value = stats[torch_name]
            if "bytes" in torch_name:
                line += f" | {name.replace('bytes', 'gigabytes')}: {bridge_gigabytes(value)}"
            else:
                line += f" | {name}: {value}"
    return f"[Rank {rank}] {line}"


def bridge_stats(allocated: int, max_allocated: int, reserved: int, max_reserved: int, retries: int = 0) -> dict:
    """The ``torch.cuda.memory_stats()`` keys Bridge's report reads (active = allocated, no inactive split)."""
    return {"allocated_bytes.all.current": allocated, "active_bytes.all.current": allocated,
            "inactive_split_bytes.all.current": 0, "reserved_bytes.all.current": reserved,
            "allocated_bytes.all.peak": max_allocated, "active_bytes.all.peak": max_allocated,
            "inactive_split_bytes.all.peak": 0, "reserved_bytes.all.peak": max_reserved,
            "num_alloc_retries": retries, "allocation.all.current": 500}


def megatron_memory_line(rank: int, iteration: int, allocated: int, max_allocated: int, reserved: int,
                         max_reserved: int) -> str:
    """Megatron-LM's ``report_memory`` (megatron/training/utils.py): MB = 1024 * 1024 bytes, unrounded floats."""
    mb = 1024.0 * 1024.0
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {allocated / mb} | max allocated: "
            f"{max_allocated / mb} | reserved: {reserved / mb} | max reserved: {max_reserved / mb}")


def bridge_layout_lines(tp: int, pp: int, cp: int = 1, ep: int = 1) -> list[str]:
    """Rank 0's layout lines: training/initialize.py L830-837 and ConfigContainer.log_non_default_values."""
    lines = [f"> initialized tensor model parallel with size {tp}", f"> initialized pipeline model parallel with size {pp}",
             "[model] Non-default values (vs Mcore TransformerConfig):"]
    for name, value in (("context_parallel_size", cp), ("expert_model_parallel_size", ep),
                        ("pipeline_model_parallel_size", pp), ("tensor_model_parallel_size", tp)):
        if value != 1:
            lines.append(f"  {name}: {value!r}  (Mcore default: 1)")
    return lines


def prefixed(rank: int, line: str, style: str = "torch") -> str:
    """A rank's line as a launcher writes it: "torch" ``[rank3]:``, "torchrun" ``[default3]:``, "slurm" ``3: ``,
    "mpi" ``[1,3]<stderr>:``."""
    return {"torch": f"[rank{rank}]: ", "torchrun": f"[default{rank}]:", "slurm": f"{rank}: ",
            "mpi": f"[1,{rank}]<stderr>:"}[style] + line


RUN_TP, RUN_PP, RUN_DP, RUN_FAILING = 2, 2, 2, 6
"""The example run: 8 ranks, TP 2 x PP 2 x DP 2; rank 6 (PP stage 1, TP 0, DP 1) runs out of memory."""


def run_max_allocated(rank: int, iteration: int) -> int:
    return (30 + rank + 5 * iteration) * 10**9


def run_lines(style: str = "torch", failing: int = RUN_FAILING, reporters=None, layout: bool = True) -> list[str]:
    """The example run's merged log: rank 0's layout lines, iterations 1 and 2 of every rank interleaved, memory
    reports on the data-parallel-rank-0 ranks, then ``failing``'s OOM traceback printed twice (as a rank and then
    torchrun's error summary print it)."""
    gb = 10**9
    reporters = [r for r in range(8) if (r // RUN_TP) % RUN_DP == 0] if reporters is None else reporters
    lines = [prefixed(0, x, style) for x in bridge_layout_lines(RUN_TP, RUN_PP)] if layout else []
    for iteration in (1, 2):
        for rank in range(8):
            lines.append(prefixed(rank, f" iteration {iteration}/ 10 | consumed samples: {8 * iteration}", style))
            if rank in reporters:
                stats = bridge_stats(20 * gb, run_max_allocated(rank, iteration), 50 * gb, 52 * gb)
                lines.append(prefixed(rank, bridge_memory_line(rank, iteration, stats), style))
    message = allocator_oom(2 * GIB, total=80 * GIB, free=100 * MIB, allocated=60 * GIB, reserved=79 * GIB)
    lines += [prefixed(failing, x, style) for x in traceback(message)] * 2
    return lines


if __name__ == "__main__":  # tests/data/diagnose/merged-8-ranks.log: python -m tests.support.oom_logs > ...
    print("\n".join(run_lines()))
