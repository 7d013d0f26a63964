"""Which LoRA adapters may keep their LoRA-A input sequence-sharded, in one process (no ranks).

* eligibility.py's rules, table-driven, on stand-ins for Bridge's LoRALinear;
* eligibility for a wrapper with several adapters (CanonicalLoRA's), on stand-ins.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_bridge_ext.levers.lora_input.eligibility import (
    Decision,
    decide,
    decide_wrapper,
    ineligibility,
    recompute_reason,
)
from tests.support.peft import _adapter, _split_wrapper

pytestmark = [pytest.mark.unit]

STRATEGIES = ("regather", "shard_local")


# ------------------------------------------------------------------------------------------ eligibility rules


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _stand_in(
    *,
    surface="linear_qkv",
    row_parallel=False,
    sequence_parallel=True,
    tp=2,
    tp_group=True,
    expert=False,
    a2a=False,
    base_sequence_parallel=True,
    parallel_mode="column",
    explicit_expert_comm=False,
    lora_a_trainable=True,
    activation=None,
    cuda_graph_impl="none",
    enable_cuda_graph=False,
    cpu_offloading=False,
    cpu_offloading_activations=False,
    recompute_granularity=None,
    recompute_modules=None,
    te=False,
    shared_expert=False,
    shared_expert_ffn=None,
):
    """The attributes of Bridge's LoRALinear (adapter, to_wrap and their configs) that the rules read;
    ``shared_expert`` puts the layer in an MoE layer's shared-expert MLP."""
    config = SimpleNamespace(
        sequence_parallel=sequence_parallel, tensor_model_parallel_size=tp, cuda_graph_impl=cuda_graph_impl,
        enable_cuda_graph=enable_cuda_graph, cpu_offloading=cpu_offloading,
        cpu_offloading_activations=cpu_offloading_activations, recompute_granularity=recompute_granularity,
        recompute_modules=recompute_modules, moe_shared_expert_intermediate_size=shared_expert_ffn,
    )
    parent = "mlp.shared_experts" if shared_expert else "block"
    adapter = SimpleNamespace(
        base_linear_name=f"decoder.layers.3.{parent}.{surface}", input_is_parallel=row_parallel,
        tp_group=_Group(tp) if tp_group else None, config=config, is_expert=expert, use_a2a=a2a,
        linear_in=SimpleNamespace(weight=torch.zeros(2, 2, requires_grad=lora_a_trainable)),
        activation=activation if activation is not None else nn.Identity(),
    )
    base = SimpleNamespace(config=config, sequence_parallel=base_sequence_parallel, parallel_mode=parallel_mode,
                           explicit_expert_comm=explicit_expert_comm)
    if te:  # a TE LayerNorm-linear can return its norm output
        base.return_layernorm_output_gathered = False
    return SimpleNamespace(adapter=adapter, to_wrap=base)


BOTH = STRATEGIES


# (case, stand-in fields, strategies that refuse it, reason fragment)
RULES = [
    ("row-parallel surface", dict(surface="linear_proj"), BOTH, "linear_proj is not a column-parallel LoRA target"),
    ("row-parallel adapter", dict(row_parallel=True), BOTH, "the adapter is row-parallel"),
    ("SP off", dict(sequence_parallel=False), BOTH, "sequence parallelism is off"),
    ("TP=1 from the group", dict(tp=1), BOTH, "tensor parallel size is 1"),
    ("TP=1 from the config", dict(tp=1, tp_group=False), BOTH, "tensor parallel size is 1"),
    ("expert", dict(surface="linear_fc1", expert=True), BOTH, "expert adapters are not supported"),
    ("expert on an expert-TP group of 1", dict(surface="linear_fc1", expert=True, tp=1), BOTH,
     "input comes through the token dispatcher"),
    ("all-to-all", dict(a2a=True), BOTH, "all-to-all adapters are not supported"),
    ("base without SP", dict(base_sequence_parallel=False), BOTH, "does no sequence-parallel communication"),
    ("TE base with parallel_mode=None", dict(parallel_mode=None), BOTH, "does no sequence-parallel communication"),
    ("shared expert with explicit comm", dict(surface="linear_fc1", explicit_expert_comm=True), BOTH,
     "does no sequence-parallel communication"),
    ("frozen LoRA-A", dict(lora_a_trainable=False), BOTH, "LoRA-A is frozen"),
    ("non-identity activation", dict(activation=nn.SiLU()), BOTH, "activation is not identity"),
    ("CUDA graphs (impl)", dict(cuda_graph_impl="local"), BOTH, "CUDA graphs are enabled"),
    ("CUDA graphs (legacy flag)", dict(enable_cuda_graph=True), BOTH, "CUDA graphs are enabled"),
    ("CPU activation offloading", dict(cpu_offloading=True, cpu_offloading_activations=True), BOTH,
     "CPU activation offloading is enabled"),
    ("CPU weight offloading only", dict(cpu_offloading=True), (), None),
    ("full recompute", dict(recompute_granularity="full"), ("regather",), "full activation recompute"),
    ("mlp recompute, linear_fc1", dict(surface="linear_fc1", recompute_granularity="selective", recompute_modules=["mlp"]),
     ("regather",), "selective 'mlp' recompute"),
    ("mlp recompute, linear_qkv", dict(recompute_granularity="selective", recompute_modules=["mlp"]), (), None),
    ("core_attn recompute, linear_fc1", dict(surface="linear_fc1", recompute_granularity="selective",
                                             recompute_modules=["core_attn"]), (), None),
    ("shared_experts recompute, shared expert linear_fc1",
     dict(surface="linear_fc1", shared_expert=True, recompute_granularity="selective",
          recompute_modules=["shared_experts"]), ("regather",), "selective 'shared_experts' recompute"),
    ("moe recompute, shared expert linear_fc1",
     dict(surface="linear_fc1", shared_expert=True, recompute_granularity="selective", recompute_modules=["moe"]),
     ("regather",), "selective 'moe' recompute already covers a shared expert's linear_fc1"),
    ("mlp recompute, shared expert linear_fc1 (Core recomputes dense MLPs only)",
     dict(surface="linear_fc1", shared_expert=True, recompute_granularity="selective", recompute_modules=["mlp"]),
     (), None),
    ("moe recompute, dense linear_fc1", dict(surface="linear_fc1", recompute_granularity="selective",
                                             recompute_modules=["moe", "shared_experts"]), (), None),
    ("eligible shared expert linear_fc1", dict(surface="linear_fc1", shared_expert=True), (), None),
    ("eligible linear_qkv", dict(), (), None),
    ("eligible linear_fc1", dict(surface="linear_fc1"), (), None),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case, fields, refused_by, reason", RULES, ids=[r[0] for r in RULES])
def test_eligibility_rule(strategy, case, fields, refused_by, reason):
    lora_linear = _stand_in(**fields)
    decision = decide(lora_linear, strategy)
    assert decision.adapter == lora_linear.adapter.base_linear_name and decision.requested == strategy
    if strategy in refused_by:
        assert (decision.strategy, decision.eligible) == ("off", False)
        assert reason in decision.reason
    else:
        assert (decision.strategy, decision.eligible, decision.reason) == (strategy, True, "eligible")
        assert ineligibility(lora_linear, strategy) is None


@pytest.mark.parametrize("shared_expert_ffn, refused", [(None, False), (32, True)])
def test_before_the_model_exists_moe_recompute_refuses_regather_only_with_shared_experts(shared_expert_ffn, refused):
    """``MemoryConfig.validate`` asks without a layer: 'moe' recompute covers a linear_fc1 only where the model
    has shared experts (a routed expert's is never eligible)."""
    config = _stand_in(shared_expert_ffn=shared_expert_ffn).to_wrap.config
    config.recompute_granularity, config.recompute_modules = "selective", ["moe"]
    reason = recompute_reason(config, "linear_fc1", "regather")
    assert (reason is not None) == refused
    assert recompute_reason(config, "linear_fc1", "shard_local") is None


def test_a_shared_experts_lora_a_shares_the_routers_copy_of_the_shard():
    """A shared expert's input is the MoE layer's input, which Core's router saves for its own backward: the
    shard is no new tensor and the report states the whole s*b*h saving."""
    decision = decide(_stand_in(surface="linear_fc1", shared_expert=True), "shard_local")
    assert decision.eligible and "router" in decision.retains and "s*b*h*1 elements less" in decision.retains


def test_an_expert_adapter_retains_the_dispatched_tokens():
    """A routed expert's LoRA-A keeps what Bridge's keeps: the tokens sent to it, not a sequence-parallel input."""
    decision = decide(_stand_in(surface="linear_fc1", expert=True, tp=1), "shard_local")
    assert "dispatcher routed to this expert" in decision.retains


def test_no_strategy_requested_is_off_for_every_adapter():
    decision = decide(_stand_in(), "off")
    assert decision == Decision(decision.adapter, "off", "off", "off (no strategy requested)",
                                "the gathered input [s, b, h]", f"{decision.adapter}.adapter.linear_in")
    assert not decision.eligible


@pytest.mark.parametrize("case, fields, strategy, retains", [
    ("column, eligible, local spec", dict(), "shard_local", "s*b*h*(1-1/t)"),
    ("column, eligible, TE", dict(te=True), "regather", "the storage TE keeps"),
    ("column, off", dict(), "off", "the gathered input [s, b, h]"),
    ("column, SP off", dict(sequence_parallel=False), "shard_local", "no sequence parallelism"),
    ("row-parallel", dict(surface="linear_proj", row_parallel=True), "shard_local", "already split over TP"),
    ("frozen LoRA-A", dict(lora_a_trainable=False), "shard_local", "nothing"),
])
def test_report_says_what_lora_a_retains(case, fields, strategy, retains):
    assert retains in decide(_stand_in(**fields), strategy).retains


def _assigned_attributes(module_name: str, class_name: str) -> set[str]:
    """Every ``self.<name> = ...`` in a class of an installed module (read from its source)."""
    import ast
    import importlib.util

    source = open(importlib.util.find_spec(module_name).origin).read()
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_the_stand_in_reads_attributes_that_bridge_and_core_really_have(ours):
    """_stand_in's names are the ones ParallelLinearAdapter and ColumnParallelLinear assign (upstream drift fails)."""
    stand_in = _stand_in()
    adapter = _assigned_attributes("megatron.bridge.peft.utils", "ParallelLinearAdapter")
    assert set(vars(stand_in.adapter)) <= adapter, set(vars(stand_in.adapter)) - adapter
    column = _assigned_attributes("megatron.core.tensor_parallel.layers", "ColumnParallelLinear")
    te_only = {"parallel_mode"}  # Transformer Engine's attribute (its modules are not installed here)
    assert set(vars(stand_in.to_wrap)) - te_only <= column, set(vars(stand_in.to_wrap)) - column


@pytest.mark.parametrize("fp8, saving", [(None, "s*b*h elements less"), ("e4m3", "s*b*h*(1-1/t) elements less")])
def test_the_report_states_the_te_saving_with_and_without_fp8(fp8, saving):
    """Under FP8 TE keeps a quantised copy of the shard that LoRA-A cannot share: the report says (1-1/t)."""
    from megatron_bridge_ext.levers.lora_input.eligibility import retained

    wrapper = _stand_in(te=True)
    wrapper.to_wrap.config.fp8 = fp8
    assert saving in retained(wrapper, "shard_local")


def test_the_adapters_of_a_layer_share_one_verdict_and_one_shard():
    adapters = {"adapter_q": _adapter(), "adapter_k": _adapter(), "adapter_v": _adapter()}
    wrapper = _split_wrapper(adapters)
    decisions = decide_wrapper(wrapper, "shard_local", [(f"adapter.{k}", a) for k, a in adapters.items()])
    base = "decoder.layers.0.self_attention.linear_qkv"
    assert [(d.adapter, d.lora_a) for d in decisions] == [
        (f"{base}.{k}", f"{base}.adapter.{k}.linear_in") for k in adapters]
    assert {(d.strategy, d.reason) for d in decisions} == {("shard_local", "eligible")}
    assert all("one storage for the 3 adapters" in d.retains and "s*b*h*(3-1/t)" in d.retains for d in decisions)

    # One adapter refused refuses the layer: they all take the base layer's one input.
    adapters["adapter_k"] = _adapter(trainable=False)
    decisions = decide_wrapper(wrapper, "shard_local", [(f"adapter.{k}", a) for k, a in adapters.items()])
    frozen = "LoRA-A is frozen (its input is not retained anyway)"
    assert {(d.strategy, d.reason) for d in decisions} == {("off", frozen)}


@pytest.mark.parametrize("te, dropout, retains", [
    (False, False, "its own gathered copy of the input"),
    (True, False, "one copy for the 3 adapters"),
    (False, True, "its own gathered copy of the input"),
])
def test_the_report_says_what_a_layers_adapters_keep_on_bridges_path(te, dropout, retains):
    adapters = [(f"adapter.{k}", _adapter(dropout=dropout)) for k in ("adapter_q", "adapter_k", "adapter_v")]
    decisions = decide_wrapper(_split_wrapper(dict(adapters), te=te), "off", adapters)
    assert all(retains in d.retains for d in decisions)


def test_with_adapter_dropout_each_lora_a_keeps_its_own_dropped_shard():
    adapters = [(f"adapter.{k}", _adapter(dropout=True)) for k in ("adapter_up", "adapter_gate")]
    decisions = decide_wrapper(_split_wrapper(dict(adapters)), "regather", adapters)
    assert all(d.eligible and "its own dropped sequence shard" in d.retains for d in decisions)
