"""The model one rank of a Bridge config builds: the config's own provider, on fake tensors.

Bridge's ``provider.provide()`` runs under ``FakeTensorMode`` inside :func:`..fake.fake_parallel_world`,
so the GPTModel has this rank's real parameter shapes (TP shards, this pipeline stage's layers,
its embedding or output layer) and costs no memory. The config's PEFT object then transforms it
outside the fake mode (adapters call ``.to(dtype)`` on real modules, which a fake module refuses;
adapters are small), and every parameter is swapped for a fake one on the traced device in the
model's training dtype, as Megatron's ``Float16Module`` casts the whole model.

The layer spec is Megatron Core's local one (Transformer Engine cannot run here), with a fused
attention stand-in unless the local unfused attention is asked for; what Transformer Engine's
fused norm-linear keeps differently is added by :mod:`.te`.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

FUSED = "fused"
LOCAL = "local"
ATTENTIONS = (FUSED, LOCAL)


def layer_spec(provider, attention: str):
    """Megatron Core's local GPT layer spec for ``provider``'s norms and experts, with the attention kind asked for.

    With experts it is Core's local MoE spec: the router, the config's token dispatcher and SequentialMLP
    experts (the local backend has no grouped GEMM, whatever ``moe_grouped_gemm`` asks; the estimate
    says so in its assumptions).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    experts = getattr(provider, "num_moe_experts", None)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=bool(getattr(provider, "moe_grouped_gemm",
                                                                                        False)) if experts else False,
                                    qk_layernorm=bool(provider.qk_layernorm), normalization=provider.normalization)
    if attention == FUSED:
        from megatron_bridge_ext.estimate.standins import FusedAttentionStandIn

        spec.submodules.self_attention.submodules.core_attention = FusedAttentionStandIn
    return spec


def build_rank_model(provider, peft, *, attention: str, mode: FakeTensorMode, device: str,
                     dtype: torch.dtype) -> torch.nn.Module:
    """This rank's GPTModel in training mode, with ``peft`` applied, every parameter fake on ``device``.

    ``provider`` is a finalized copy the caller owns (it is changed: spec, initialisation flags).
    Must run inside :func:`..fake.fake_parallel_world`.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnBackend

    provider.transformer_layer_spec = layer_spec(provider, attention)
    provider.attention_backend = AttnBackend.auto  # the spec chooses the attention; "local" would replace the stand-in
    provider.use_cpu_initialization = True
    provider.perform_initialization = False
    provider.gradient_accumulation_fusion = False
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    with mode:
        model = provider.provide()
    if peft is not None:
        model = _apply_peft(model, copy.deepcopy(peft))
    _to_fake_device(model, mode, device, dtype)
    return model.train()


def _apply_peft(model, peft):
    """``peft(model)`` as training does, with its per-adapter log lines held back (a trace is not a run).

    The adapters are created on the CPU (``use_cpu_initialization``), so Megatron's collectives that
    allocate on ``torch.cuda.current_device()`` while they are built (DoRA gathers the adapter weights
    over TP for its magnitude's initial norm) allocate there too: same shapes, no GPU needed, and no
    CPU/GPU mix where a GPU is present.
    """
    from megatron_bridge_ext.estimate.fake import current_device, scoped_patch
    from megatron_bridge_ext.patches import bridge_truthful_te_detection

    with scoped_patch(bridge_truthful_te_detection.PATCH), current_device("cpu"), \
            _quiet("megatron.bridge", "megatron_bridge_ext.peft"):
        out = peft(model, training=True)
    return out[0] if isinstance(out, list) else out


@contextlib.contextmanager
def _quiet(*names: str):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _to_fake_device(model: torch.nn.Module, mode: FakeTensorMode, device: str, dtype: torch.dtype) -> None:
    """Every parameter and buffer becomes a fake tensor on ``device``; floating parameters take ``dtype``.

    The Parameter objects are replaced, keeping Megatron's attributes on them (``tensor_model_parallel``,
    ``sequence_parallel``, ...) and ``requires_grad``, but not the fake tensor's own attributes.
    """
    with torch.no_grad(), mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                fake = param.detach() if isinstance(param, FakeTensor) else mode.from_tensor(param.detach())
                fake = fake.to(device=device, dtype=dtype if param.is_floating_point() else param.dtype)
                new = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
                new.__dict__.update({k: v for k, v in param.__dict__.items() if k not in new.__dict__})
                module._parameters[name] = new
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    fake = buffer if isinstance(buffer, FakeTensor) else mode.from_tensor(buffer)
                    module._buffers[name] = fake.to(device)
