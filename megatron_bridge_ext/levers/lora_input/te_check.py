"""Does this cluster's Transformer Engine drop LoRA's input gradient under sequence parallelism?

One TE ``LayerNormColumnParallelLinear`` (TP over ``group``, sequence parallelism on, a frozen base
as in LoRA) wrapped by a LoRA adapter, run three ways: Megatron Bridge's LoRA as shipped, Bridge's
LoRA with the ``bridge_lora_te_norm_grad`` patch, and megatron_bridge_ext's ``shard_local``. Each
run's output, input gradient and LoRA gradients are compared with the same function computed
densely in float64 on every rank (LayerNorm, base GEMM, LoRA-A/B with the unsharded weights).
Used by ``scripts/te_lora_grad_check.py`` on a cluster with TE, and by the tests on a CPU fake of
TE's layer that follows TE's source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

RUNS = ("bridge", "bridge_patched", "off", "regather", "shard_local")
"""Bridge's LoRA as shipped and patched; ours with the strategy off (which applies the patch), regather, shard_local."""

DROPPED = 1e-2
"""A relative input-gradient error above this means the LoRA branch's gradient was lost (it is O(1) then)."""


@dataclass
class RunResult:
    run: str
    errors: dict[str, float]
    saved_bytes: int
    reference_nonzero: dict[str, bool] = field(default_factory=dict)


def _gather(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _rank_slice(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    return tensor.chunk(group.size(), dim=dim)[group.rank()]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def make_peft(run: str, rank: int = 8, alpha: int = 16):
    """The LoRA of ``run`` on ``linear_qkv``."""
    from megatron_bridge_ext.patches import bridge_peft_without_te

    bridge_peft_without_te.import_bridge_peft()
    if run in ("bridge", "bridge_patched"):
        from megatron.bridge.peft.lora import LoRA
        return LoRA(target_modules=["linear_qkv"], dim=rank, alpha=alpha)
    from megatron_bridge_ext.peft import LoRA

    return LoRA(target_modules=["linear_qkv"], dim=rank, alpha=alpha, sequence_parallel_input_strategy=run)


def wrap(base: nn.Module, run: str, seed: int = 4321, *, as_is: bool = False):
    """``base`` as ``linear_qkv`` of a container, with ``run``'s LoRA; LoRA-B re-drawn (non-zero), seeded.

    ``as_is``: leave the ``bridge_lora_te_norm_grad`` patch as this process has it (e.g. after
    ``megatron_bridge_ext.init()``) instead of applying it (``bridge_patched``) or reverting it (``bridge``).
    """
    from megatron.bridge.peft.lora_layers import LoRALinear

    from megatron_bridge_ext.patches import bridge_lora_te_norm_grad, bridge_truthful_te_detection

    patch = bridge_lora_te_norm_grad.PATCH
    if run == "bridge_patched" and not as_is:
        patch.apply()
    bridge_truthful_te_detection.PATCH.apply()
    root = nn.Module()
    root.add_module("linear_qkv", base)
    torch.manual_seed(seed)
    root = make_peft(run)(root, training=True)
    if run == "bridge" and not as_is:  # our LoRA applies the patch when it transforms; this run must stay unpatched
        patch.revert()
    lora_linear = root.linear_qkv
    if not isinstance(lora_linear, LoRALinear):
        raise RuntimeError(f"{run}: the LoRA did not wrap {type(base).__name__} (is it a TE LayerNorm-linear?)")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = lora_linear.adapter.linear_out.weight
        weight.copy_(torch.randn(weight.shape, generator=generator).mul_(0.5).to(weight))
    return lora_linear


def _distributed(lora_linear, x, g, group):
    from megatron_bridge_ext.measure import SavedActivationMeter

    x_local = _rank_slice(x, 0, group).detach().clone().requires_grad_(True)
    with SavedActivationMeter(lora_linear) as meter:
        out, _ = lora_linear(x_local)
    (out * _rank_slice(g, -1, group).to(out.dtype)).sum().backward()
    adapter = lora_linear.adapter
    got = {"output": out.detach(), "input grad": x_local.grad, "LoRA-A grad": adapter.linear_in.weight.grad,
           "LoRA-B grad": adapter.linear_out.weight.grad}
    return got, meter.result().total_bytes


def _reference(lora_linear, x, g, group, eps: float):
    """The dense float64 computation with the unsharded weights, sliced to this rank's shards."""
    base, adapter = lora_linear.to_wrap, lora_linear.adapter
    weight = _gather(base.weight, group).double()
    gamma = base.layer_norm_weight.detach().double()
    beta = None if getattr(base, "layer_norm_bias", None) is None else base.layer_norm_bias.detach().double()
    a = _gather(adapter.linear_in.weight, group).double().requires_grad_(True)
    b = _gather(adapter.linear_out.weight, group).double().requires_grad_(True)
    xr = x.detach().double().clone().requires_grad_(True)
    if beta is None:  # RMSNorm
        norm = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * gamma
    else:
        norm = F.layer_norm(xr, (xr.shape[-1],), gamma, beta, eps)
    y = norm.matmul(weight.t()) + norm.matmul(a.t()).matmul(b.t()) * (adapter.alpha / adapter.dim)
    (y * g.double()).sum().backward()
    return {"output": _rank_slice(y.detach(), -1, group), "input grad": _rank_slice(xr.grad, 0, group),
            "LoRA-A grad": _rank_slice(a.grad, 0, group), "LoRA-B grad": _rank_slice(b.grad, 0, group)}


def run_one(make_base: Callable[[], nn.Module], run: str, group, *, seq: int, batch: int, hidden: int,
            out_features: int, eps: float = 1e-5, seed: int = 201, as_is: bool = False) -> RunResult:
    """One run against the dense reference. ``make_base()`` builds identical weights every call; ``as_is``: see
    :func:`wrap`."""
    base = make_base()
    dtype, device = base.weight.dtype, base.weight.device
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, hidden, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
    g = torch.randn(seq, batch, out_features, generator=generator, dtype=torch.float64).to(device)
    lora_linear = wrap(base, run, as_is=as_is)
    got, saved = _distributed(lora_linear, x, g, group)
    want = _reference(lora_linear, x, g, group, eps)
    return RunResult(run, {name: _rel_err(got[name], want[name]) for name in want}, saved,
                     {name: bool(want[name].any()) for name in want})


def verdict(results: dict[str, RunResult], tolerance: float) -> tuple[str, list[str]]:
    """``affected``, ``not affected`` or ``unexpected``, and the lines that support it."""
    lines = [f"{name:15} " + "  ".join(f"{k} {v:.2e}" for k, v in r.errors.items()) + f"  saved {r.saved_bytes} B"
             for name, r in results.items()]
    bad = [name for name, r in results.items() if name != "bridge" and max(r.errors.values()) > tolerance]
    if bad:
        return "unexpected", lines + [f"runs off the reference by more than {tolerance:g}: {', '.join(bad)}"]
    shipped = results["bridge"].errors
    if shipped["input grad"] > DROPPED and max(shipped[k] for k in ("output", "LoRA-A grad", "LoRA-B grad")) <= tolerance:
        return "affected", lines + ["Bridge's LoRA as shipped loses the LoRA input gradient; the patched path and "
                                    "megatron_bridge_ext's strategies are correct"]
    if max(shipped.values()) <= tolerance:
        return "not affected", lines + ["Bridge's LoRA as shipped is correct on this Transformer Engine"]
    return "unexpected", lines + ["Bridge's LoRA as shipped is off the reference in more than its input gradient"]
