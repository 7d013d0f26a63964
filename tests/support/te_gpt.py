"""A tiny GPT whose ``linear_qkv`` and ``linear_fc1`` are the TE fake, and its dense float64 reference.

:func:`fake_te_spec` is Megatron Core's local layer spec with the fused TE LayerNorm-linear in place
of ``input_layernorm + linear_qkv`` and ``pre_mlp_layernorm + linear_fc1`` (as in Core's TE spec).
:func:`full_state` gathers every tensor-parallel shard into the state of the same model built with
TP=1 on the local spec (where the norms are separate modules), with Bridge's PEFT of the same kind
(``shape.peft``). ``python -m tests.support.te_gpt IN.pt OUT.pt`` builds that TP=1 model in a single
process (world size 1), loads the state, and writes the loss and the gradient of the embedding
output: the dense reference.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import sys

import torch
import torch.distributed as dist

# Where the fused layer keeps the norm that the local spec has as its own module.
_NORM_OF = {"self_attention.linear_qkv.to_wrap.": "input_layernorm.", "mlp.linear_fc1.to_wrap.": "pre_mlp_layernorm."}


def fake_te_spec(contract: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    from tests.support.fake_te import FakeTELayerNormColumnParallelLinear

    fused = FakeTELayerNormColumnParallelLinear.under(contract)
    spec = copy.deepcopy(get_gpt_layer_local_spec())
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.pre_mlp_layernorm = IdentityOp
    layer.self_attention.submodules.linear_qkv = fused
    mlp = layer.mlp
    layer.mlp = functools.partial(mlp.func, *mlp.args,
                                  **dict(mlp.keywords, submodules=dataclasses.replace(mlp.keywords["submodules"],
                                                                                      linear_fc1=fused)))
    return spec


# Rows of the fused linear_fc1 output: under a gated MLP each TP rank holds [gate_k; up_k], TP=1 holds [gate; up].
_GATED_ROWS = re.compile(
    r"mlp\.linear_fc1\.(to_wrap\.weight|weight|adapter\.linear_out\.weight|adapter\.weight_magnitude)$")


def _split_dim(model, name: str, param: torch.Tensor):
    """The dim ``param`` is split on over TP, or None: Megatron's attribute, or for DoRA's magnitude of a
    column-parallel adapter dim 0 (Bridge marks that split only in its sharded state dict)."""
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim
    if name.endswith("adapter.weight_magnitude") and not model.get_submodule(name.rsplit(".", 1)[0]).input_is_parallel:
        return 0
    return None


def _gathered(model, name: str, param: torch.Tensor, group) -> torch.Tensor:
    dim = _split_dim(model, name, param)
    if dim is None or group.size() == 1:
        return param.detach().clone()
    parts = [torch.empty_like(param) for _ in range(group.size())]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    if dim == 0 and model.config.gated_linear_unit and _GATED_ROWS.search(name):
        halves = [part.chunk(2, dim=0) for part in parts]
        parts = [gate for gate, _ in halves] + [up for _, up in halves]
    return torch.cat(parts, dim=dim)


def _local_name(name: str) -> str:
    for fused, norm in _NORM_OF.items():
        for suffix, own in (("layer_norm_weight", "weight"), ("layer_norm_bias", "bias")):
            if name.endswith(fused + suffix):
                return name[: -len(fused + suffix)] + norm + own
    return name


def full_state(model, group) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, under the names of the TP=1 local-spec model (LoRA wrappers included)."""
    return {_local_name(name): _gathered(model, name, param, group) for name, param in model.named_parameters()}


def track_embedding_output(model) -> list[torch.Tensor]:
    """Make the (frozen) embedding's output a leaf that requires grad; the list gets it at the next forward."""
    leaves = []

    def hook(module, args, output):
        leaves.append(output.detach().requires_grad_(True))
        return leaves[-1]

    model.embedding.register_forward_hook(hook)
    return leaves


def float64_loss(model, batch: dict, weights: torch.Tensor, group) -> torch.Tensor:
    """A linear functional of the (vocab-gathered) logits, all in float64.

    Megatron Core's vocab-parallel cross entropy casts the logits to float32
    (``tensor_parallel/cross_entropy.py``), which would put float32 rounding into a float64 comparison.
    """
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    logits = model(batch["input_ids"], batch["position_ids"], attention_mask=None)
    if group is not None and group.size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits, group=group)
    return (logits * weights.to(logits)).sum()


def _reference(inputs: dict) -> dict:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_bridge_ext.testing import tiny_model

    shape = dataclasses.replace(tiny_model.TinyGPTShape(**inputs["shape"]), tp=1, sequence_parallel=False)
    config = tiny_model.transformer_config(shape)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=shape.vocab,
                     max_sequence_length=shape.seq, position_embedding_type="rope").to(shape.torch_dtype)
    model = tiny_model.apply_peft(model, tiny_model.bridge_lora(shape))
    model.load_state_dict(inputs["state"], strict=False)
    names = {n for n, _ in model.named_parameters()}
    if names != set(inputs["state"]):
        raise SystemExit(f"state names differ from the TP=1 model: {sorted(names ^ set(inputs['state']))}")
    leaf = track_embedding_output(model)
    loss = float64_loss(model, inputs["batch"], inputs["loss_weights"], group=None)
    loss.backward()
    return {"loss": loss.detach(), "embedding_grad": leaf[0].grad}


def main() -> None:
    source, target = sys.argv[1:3]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MBX_REFERENCE_PORT", "29533"))
    from megatron_bridge_ext.testing import cpu_emulation

    cpu_emulation.install()
    from megatron_bridge_ext.testing import distributed

    distributed.init_from_env(tensor_parallel=1)
    torch.save(_reference(torch.load(source, weights_only=False)), target)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
