"""Shared pieces of the 2-rank LoRA tests: the per-adapter problem, blocks wrapped by a variant's PEFT,
the tiny GPT with a variant and a PEFT kind (LoRA, DoRA, CanonicalLoRA), and comparisons that report
problems instead of asserting (so that both ranks can agree on a verdict; see
:mod:`tests.support.dist_checks`)."""

from __future__ import annotations

import torch
from torch import nn

from megatron_bridge_ext.testing import tiny_model as tm
from megatron_bridge_ext.testing.variants import VARIANTS
from tests.support.dist_checks import local_rel_err

TP = 2
STRATEGIES = ("regather", "shard_local")
KINDS = ("lora", "dora", "canonical_lora")
ELIGIBLE_SURFACES = ("linear_qkv", "linear_fc1")
FP32_REL_TOL = 1e-6
PEFT_LOGGER = "megatron_bridge_ext.peft"
"""Our LoRA, DoRA and CanonicalLoRA log under its children (``megatron_bridge_ext.peft.lora``, ...)."""

# The per-adapter problem: s*b*h, s*b*r and r*h all differ, so every collective is identifiable by size.
S, B, H, OUT, R = 8, 3, 32, 48, 8


# --------------------------------------------------------------------------------------------- helpers


def _device() -> torch.device:
    from megatron_bridge_ext.testing.distributed import device

    return device()


def _shape(kind: str = "lora", **fields) -> tm.TinyGPTShape:
    """The tiny GPT's shape for PEFT ``kind``: CanonicalLoRA's up/gate adapters are the halves of a gated
    (SwiGLU) linear_fc1, so that kind gets SwiGLU."""
    return tm.TinyGPTShape(peft=kind, swiglu=kind == "canonical_lora", **fields)


def _gpt(shape: tm.TinyGPTShape, variant: str, seed: int = 1234, peft_seed: int = 4321, peft_fields=None, **config):
    """The tiny GPTModel with ``variant``'s PEFT of kind ``shape.peft`` applied (``peft_fields`` set on the
    PEFT before it transforms, e.g. dropout); returns (model, peft)."""
    peft, variant_config = VARIANTS[variant].apply(shape, **config)
    for name, value in (peft_fields or {}).items():
        setattr(peft, name, value)
    model = tm.apply_peft(tm.build_gpt(shape, seed=seed, **config, **variant_config), peft, seed=peft_seed)
    return model, peft


def _adapter_names(shape: tm.TinyGPTShape, surfaces=None) -> list[str]:
    parent = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
    return [
        f"decoder.layers.{layer}.{parent[surface]}.{surface}"
        for layer in range(shape.layers)
        for surface in (surfaces or shape.lora_targets)
    ]


# CanonicalLoRA's adapters of the fused layers, in the order of Bridge's ModuleDicts.
_SPLIT = {"linear_qkv": ("adapter_q", "adapter_k", "adapter_v"), "linear_fc1": ("adapter_up", "adapter_gate")}


def _adapters(shape: tm.TinyGPTShape, surfaces=None) -> list[tuple[str, str]]:
    """(name in ``report()``, LoRA-A module path) of every adapter of kind ``shape.peft`` on ``surfaces``."""
    out = []
    for name in _adapter_names(shape, surfaces):
        keys = _SPLIT.get(name.rsplit(".", 1)[-1], ()) if shape.peft == "canonical_lora" else ()
        split = [(f"{name}.{key}", f"{name}.adapter.{key}.linear_in") for key in keys]
        out += split or [(name, f"{name}.adapter.linear_in")]
    return out


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _loss_and_grads(model, shape: tm.TinyGPTShape, step: int = 0):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    # Adapter dropout draws the same masks in every model: under sequence parallelism the transformer
    # block runs in Megatron's model-parallel RNG state, which each forward advances.
    model_parallel_cuda_manual_seed(1000 + step)
    loss = tm.loss_of(model, tm.synthetic_batch(shape, step))
    loss.backward()
    grads = {name: (p.grad.detach().clone() if p.grad is not None else None) for name, p in _trainable(model).items()}
    return loss.detach(), grads


def _ddp_like_microbatches(model, shape: tm.TinyGPTShape, steps=(0, 1)) -> dict[str, bool]:
    """Accumulate ``steps`` microbatches into ``main_grad`` as Megatron Core's DDP does.

    Before the first microbatch every trainable parameter gets a zero fp32 ``main_grad`` and
    ``grad_added_to_main_grad = False``. After each backward, DDP's hook adds ``param.grad`` to
    ``main_grad`` unless the fused wgrad path already did (flag set), and drops ``param.grad``.
    Returns, per parameter, whether the fused path accumulated it.
    """
    params = _trainable(model)
    for p in params.values():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
    for step in steps:
        tm.loss_of(model, tm.synthetic_batch(shape, step)).backward()
        for p in params.values():
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad.float())
            p.grad = None
    return {name: bool(p.grad_added_to_main_grad) for name, p in params.items()}


def _compare(got: dict, want: dict, *, bitwise: bool, tol: float = FP32_REL_TOL) -> list[str]:
    """Problems found comparing named tensors: bitwise, or within ``tol`` relative to max|want|."""
    problems = []
    if set(got) != set(want):
        problems.append(f"names differ: {sorted(set(got) ^ set(want))}")
    for name, w in want.items():
        g = got.get(name)
        if g is None or w is None:
            problems.append(f"{name}: missing tensor (got {g is not None}, want {w is not None})")
        elif bitwise and not torch.equal(g, w):
            problems.append(f"{name}: not bitwise equal (rel err {local_rel_err(g, w):.3g})")
        elif not bitwise and local_rel_err(g, w) > tol:
            problems.append(f"{name}: rel err {local_rel_err(g, w):.3g} > {tol:g}")
    return problems


def _nontrivial(tensors: dict) -> list[str]:
    """A comparison of zeros proves nothing: every reference tensor must have a non-zero entry."""
    return [f"{name} is all zeros" for name, t in tensors.items() if t is not None and not t.any()]


def _rank_slice(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    return tensor.chunk(group.size(), dim=dim)[group.rank()]


def _problem(seed: int, dtype=torch.float32):
    """Global input x [S, B, H] and output grad g [S, B, OUT]; identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(S, B, OUT, generator=gen, dtype=torch.float64).to(dtype)
    return x.to(_device()), g.to(_device())


def _peft(variant: str, shape: tm.TinyGPTShape):
    """``variant``'s PEFT of kind ``shape.peft``, or (``"off"``) ours of that kind with the strategy off."""
    if variant == "off":
        from megatron_bridge_ext.peft import kinds

        return kinds.our_class(shape.peft)(**tm.peft_fields(shape), sequence_parallel_input_strategy="off")
    return VARIANTS[variant].apply(shape).peft


def _wrap(base: nn.Module, surface: str, variant: str, *, prefix: str = "", peft_seed: int = 4321):
    """``base`` at the module path ``prefix.surface`` of a container, with ``variant``'s PEFT; returns (root, peft)."""
    shape = tm.TinyGPTShape(hidden=H, lora_rank=R, lora_targets=[surface])
    peft = _peft(variant, shape)
    parts = [p for p in prefix.split(".") if p] + [surface]
    root = parent = nn.Module()
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        child = base if last else (nn.ModuleList() if parts[index + 1].isdigit() else nn.Module())
        if isinstance(parent, nn.ModuleList):
            parent.append(child)
        else:
            parent.add_module(part, child)
        parent = child
    return tm.apply_peft(root, peft, seed=peft_seed), peft


def _block(base: nn.Module, surface: str, variant: str) -> nn.Module:
    return _wrap(base, surface, variant)[0]


def _parallel_config(dtype=torch.float32, **fields):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=TP, sequence_parallel=True, use_cpu_initialization=True, params_dtype=dtype, **fields
    )


def _column_parallel(tp_group, seed: int = 7, dtype=torch.float32, **config_fields):
    """Megatron Core's ColumnParallelLinear(h -> out) with SP; identical weights for identical seeds."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(seed)
    return ColumnParallelLinear(
        H, OUT, config=_parallel_config(dtype, **config_fields), init_method=nn.init.xavier_normal_,
        bias=False, gather_output=False, tp_group=tp_group,
    ).to(_device())


def _lora_linear(block: nn.Module):
    from megatron.bridge.peft.lora_layers import LoRALinear

    found = [m for m in block.modules() if isinstance(m, LoRALinear)]
    assert len(found) == 1, found
    return found[0]


def _run_lora_linear(lora_linear, x, g, group):
    """Forward and backward of one LoRALinear on this rank's shard; returns (output, x_k grad, A grad, B grad)."""
    x_local = _rank_slice(x, 0, group).detach().clone().requires_grad_(True)
    out, _ = lora_linear(x_local)
    (out * _rank_slice(g, -1, group)).sum().backward()
    adapter = lora_linear.adapter
    return {
        "output": out.detach(),
        "input grad": x_local.grad,
        "LoRA-A grad": adapter.linear_in.weight.grad,
        "LoRA-B grad": adapter.linear_out.weight.grad,
    }
