"""Megatron Bridge's own ``finetune`` loop on a mixture-of-experts GPT with our flags, on the 2 ranks.

The recipe is the tiny Bridge recipe with :func:`~megatron_bridge_ext.testing.bridge.recipe.with_experts`:
every layer's MLP is Megatron Core's local-spec MoE layer (SequentialMLP experts, a top-2 router, the
allgather token dispatcher), TP=2 with sequence parallelism, EP=2 and expert TP=1 on the same two ranks.
Bridge's LoRA targets linear_qkv, linear_proj, linear_fc1 and linear_fc2, so it adapts every local
expert's linear_fc1 and linear_fc2 as well; of all these adapters only linear_qkv's is eligible for a
LoRA-A input strategy (a routed expert's input comes through the token dispatcher).

As in ``test_bridge_loop.py`` (and through the same ``tests.support.bridge_runs``), the runs (Bridge's
``pretrain``, then ``finetune`` with ``gpt_step.forward_step``, torch_dist checkpoints) happen once, in
the ``runs`` fixture, and our LoRA comes in through ``MemoryConfig(...).apply(cfg)`` on a config whose
``cfg.peft`` is Bridge's LoRA.
Expected numbers come from Bridge's own LoRA (bitwise where the arithmetic is the same), from a float64
run of Bridge's LoRA from the same checkpoint (``shard_local``, whose sums are ordered differently), from an
uninterrupted run (a resume is bitwise), from Bridge's checkpoint (names and shapes) and from the
recipe's shape (recompute counts, adapter counts, checkpoint shapes).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_bridge_ext.levers.lora_input.eligibility import EXPERT_INPUT
from megatron_bridge_ext.testing.bridge import recipe
from tests.support.bridge_runs import (
    USER_ALLOCATOR_OPTION,
    Outcome,
    Planned,
    allocator_problems,
    last,
    loop_problems,
    outcome_of,
    run_all,
    shard_local_gradient_problems,
    shard_local_scalar_problems,
)
from tests.support.bridge_session import shared_directory
from tests.support.dist_checks import assert_no_problems

pytestmark = [pytest.mark.functional, pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning")]

RESUME_STEP = 2
FINETUNE_ITERATIONS = 4
MICRO_BATCHES = 2  # global batch 4 = 2 micro-batches of 2 (data-parallel size 1)
LOCAL_EXPERTS = recipe.EXPERTS // recipe.EXPERT_PARALLEL
REGATHER = dict(sequence_parallel_input_strategy="regather", recompute_modules=["core_attn"])
SHARD_LOCAL = dict(sequence_parallel_input_strategy="shard_local")


def plan(directory: str) -> list[Planned]:
    base = f"{directory}/base"

    def finetune(save=None, load=None, dtype=None):
        return lambda: recipe.finetune_config(
            base, train_iters=FINETUNE_ITERATIONS, save=save and f"{directory}/{save}",
            load=load and f"{directory}/{load}", ckpt_step=RESUME_STEP if load else None, dtype=dtype, moe=True)

    return [
        Planned("base", "pretrain", lambda: recipe.pretrain_config(base, moe=True)),
        Planned("bridge", "finetune", finetune(save="bridge")),
        Planned("regather+core_attn", "finetune", finetune(save="regather"), REGATHER,
                user_env_vars=dict([USER_ALLOCATOR_OPTION])),
        Planned("shard_local", "finetune", finetune(save="shard_local"), SHARD_LOCAL),
        # resumed at iteration 2 from a LoRA checkpoint: iterations 3 and 4
        Planned("shard_local <- shard_local", "finetune", finetune(load="shard_local"), SHARD_LOCAL),
        Planned("regather+core_attn <- bridge", "finetune", finetune(load="bridge"), REGATHER),
        # shard_local against exact arithmetic (tests.support.bridge_runs.fp32_bound)
        Planned("bridge <- bridge", "finetune", finetune(load="bridge"), keep_gradients=True),
        Planned("shard_local <- bridge", "finetune", finetune(load="bridge"), SHARD_LOCAL, keep_gradients=True),
        Planned("float64 bridge <- bridge", "finetune", finetune(load="bridge", dtype=torch.float64),
                keep_gradients=True, unclipped=True),
    ]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return shared_directory(str(tmp_path_factory.mktemp("bridge_loop_moe")))


@pytest.fixture(scope="module")
def runs(directory) -> dict[str, Outcome]:
    return run_all(plan(directory))


# --------------------------------------------------------------------------------------------
# The loop runs an MoE model, with our LoRA in it
# --------------------------------------------------------------------------------------------

def test_bridge_pretrains_and_fine_tunes_the_moe_model_for_every_lora(runs):
    applied = {"regather+core_attn": "regather", "shard_local": "shard_local"}
    assert_no_problems(loop_problems(runs, plan(""), applied), dist.group.WORLD)


def test_regather_with_core_attn_recompute_matches_bridges_lora_bitwise(runs):
    """Regather runs Bridge's LoRA-A GEMM on the same gathered input, and recompute repeats the same forward:
    the same losses and grad norms, bit for bit; the probe saw every layer's attention checkpointed."""
    bridge, ours = outcome_of(runs, "bridge"), outcome_of(runs, "regather+core_attn")
    per_step = {"checkpointed_forwards": recipe.LAYERS * MICRO_BATCHES, "recomputed": recipe.LAYERS * MICRO_BATCHES}
    problems = [f"regather+core_attn iteration {s.iteration}: {s.recompute} != {per_step}"
                for s in ours.steps if s.recompute != per_step]
    problems += [f"bridge iteration {s.iteration}: {s.recompute} without recompute"
                 for s in bridge.steps if any(s.recompute.values())]
    if (ours.losses(), ours.grad_norms()) != (bridge.losses(), bridge.grad_norms()):
        problems.append(f"regather+core_attn {ours.losses()} {ours.grad_norms()} vs Bridge's LoRA "
                        f"{bridge.losses()} {bridge.grad_norms()}")
    if len(set(bridge.grad_norms())) < 2:
        problems.append(f"Bridge's grad norms do not change: {bridge.grad_norms()}")  # nothing trained
    assert_no_problems(problems, dist.group.WORLD)


def test_shard_local_gradients_are_within_fp32_rounding_of_a_float64_run(runs):
    """From Bridge's iteration-2 checkpoint: shard_local's gradients (routed experts' adapters included) against
    Bridge's LoRA in float64, within twice Bridge's own fp32 error (``tests.support.bridge_runs.fp32_bound``)."""
    assert_no_problems(shard_local_gradient_problems(runs), dist.group.WORLD)


def test_shard_local_losses_and_grad_norms_match_bridges_lora_within_the_fp32_bound(runs):
    assert_no_problems(shard_local_scalar_problems(runs), dist.group.WORLD)


def test_allocator_variables_from_cfg_env_vars_are_in_the_ranks_environment(runs):
    outcome_of(runs, "regather+core_attn")  # its recipe keeps an allocator option of its own (USER_ALLOCATOR_OPTION)
    assert_no_problems(allocator_problems(runs["regather+core_attn"]), dist.group.WORLD)


# --------------------------------------------------------------------------------------------
# What the strategy says it applied
# --------------------------------------------------------------------------------------------

def _adapters_per_layer() -> dict[str, int]:
    """Bridge's adapters in one layer on this rank, by surface: one per attention linear, one per local expert's."""
    return {"linear_qkv": 1, "linear_proj": 1, "linear_fc1": LOCAL_EXPERTS, "linear_fc2": LOCAL_EXPERTS}


@pytest.mark.parametrize("name, strategy", (("regather+core_attn", "regather"), ("shard_local", "shard_local")))
def test_the_strategy_logs_what_it_applied_and_reports_the_routed_experts_not_eligible(runs, name, strategy):
    outcome_of(runs, name)
    outcome = runs[name]
    total = recipe.LAYERS * sum(_adapters_per_layer().values())
    eligible = recipe.LAYERS  # linear_qkv's adapter in each layer
    applied = f"LoRA-A input under SP ({strategy}): applied to {eligible} of {total} adapters"
    problems = [] if any(m.startswith(applied) for m in outcome.log) else [f"no '{applied}' in {outcome.log}"]
    expert_lines = [m for m in outcome.log if f"LoRA-A input under SP ({strategy}) not used" in m and EXPERT_INPUT in m]
    if not expert_lines:
        problems.append(f"no line says the routed experts' adapters are not eligible: {outcome.log}")
    report = outcome.peft.report()
    experts = [d for d in report if ".mlp.experts.local_experts." in d.adapter]
    if len(experts) != recipe.LAYERS * 2 * LOCAL_EXPERTS:
        problems.append(f"report lists {len(experts)} expert adapters, expected {recipe.LAYERS * 2 * LOCAL_EXPERTS}")
    for decision in experts:
        if decision.eligible or decision.strategy != "off":
            problems.append(f"{decision.adapter}: {decision}")
    expert_fc1 = [d for d in experts if d.adapter.endswith("linear_fc1")]
    if not expert_fc1 or any(EXPERT_INPUT not in d.reason for d in expert_fc1):
        problems.append(f"expert linear_fc1 reasons: {[d.reason for d in expert_fc1]}")
    used = sorted(d.adapter.rsplit(".", 2)[-1] for d in report if d.eligible)
    if used != ["linear_qkv"] * eligible:
        problems.append(f"eligible adapters {used}")
    assert_no_problems(problems, dist.group.WORLD)


# --------------------------------------------------------------------------------------------
# torch_dist checkpoints: resume, and Bridge's names and shapes
# --------------------------------------------------------------------------------------------

def test_resuming_from_a_lora_checkpoint_reproduces_the_uninterrupted_run_exactly(runs):
    problems = []
    for resumed, uninterrupted in (("shard_local <- shard_local", "shard_local"),
                                   ("regather+core_attn <- bridge", "bridge")):
        got, want = last(outcome_of(runs, resumed), 2), last(outcome_of(runs, uninterrupted), 2)
        if got != want:
            problems.append(f"{resumed}: {got} != {uninterrupted} iterations 3-4 {want}")
    assert_no_problems(problems, dist.group.WORLD)


def checkpoint_tensors(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of a torch_dist checkpoint directory: its key and global shape, from the metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    return {key: tuple(m.size) for key, m in metadata.items() if isinstance(m, TensorStorageMetadata)}


def expected_adapters() -> dict[str, tuple[int, ...]]:
    """Bridge's LoRA tensors in a torch_dist checkpoint of the MoE recipe: key and global shape.

    Megatron Core stacks the layers (and a SequentialMLP's experts, every expert of the EP group) into one
    sharded tensor per parameter: [layers, (experts,)] + the adapter weight's full (unsharded) shape,
    LoRA-A [rank, in_features] and LoRA-B [out_features, rank]. linear_qkv's output is the queries and
    the keys and values of each query group; every expert's width is MOE_FFN (no gated unit).
    """
    model = recipe.tiny_recipe(train_iters=1, moe=True).model
    h, heads, r = model.hidden_size, model.num_attention_heads, recipe.LORA_RANK
    qkv = h + 2 * (h // heads) * (model.num_query_groups or heads)
    layers, experts, ffn = model.num_layers, model.num_moe_experts, model.moe_ffn_hidden_size
    assert not model.gated_linear_unit, "a gated expert's linear_fc1 is twice MOE_FFN wide: adjust this formula"
    surfaces = {"self_attention.linear_qkv": ((layers,), h, qkv), "self_attention.linear_proj": ((layers,), h, h),
                "mlp.experts.experts.linear_fc1": ((layers, experts), h, ffn),
                "mlp.experts.experts.linear_fc2": ((layers, experts), ffn, h)}
    out = {}
    for surface, (stacked, fan_in, fan_out) in surfaces.items():
        out[f"decoder.layers.{surface}.adapter.linear_in.weight"] = (*stacked, r, fan_in)
        out[f"decoder.layers.{surface}.adapter.linear_out.weight"] = (*stacked, fan_out, r)
    return out


def test_our_lora_checkpoints_are_bridges_adapters_by_name_and_shape(runs, directory):
    """Each iteration-2 checkpoint holds the same tensors (adapters and their optimizer state) as Bridge's
    LoRA's, and Bridge's adapters are those of every layer and every expert (both EP ranks' experts)."""
    for name in ("bridge", "regather+core_attn", "shard_local"):
        outcome_of(runs, name)
    step = f"iter_{RESUME_STEP:07d}"
    bridge = checkpoint_tensors(os.path.join(directory, "bridge", step))
    adapters = {k: v for k, v in bridge.items() if ".adapter." in k and not k.startswith("optimizer.")}
    problems = [] if adapters == expected_adapters() else [
        f"Bridge's adapters {adapters} differ from the recipe's {expected_adapters()}"]
    for saved in ("regather", "shard_local"):
        ours = checkpoint_tensors(os.path.join(directory, saved, step))
        if ours != bridge:
            problems.append(f"{saved} vs Bridge's LoRA: {sorted(set(ours.items()) ^ set(bridge.items()))}")
    assert_no_problems(problems, dist.group.WORLD)
