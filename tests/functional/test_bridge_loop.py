"""Megatron Bridge's own pretrain/finetune loop with our flags, on the 2 ranks (gloo on CPU, NCCL on GPUs).

The runs (Bridge's ``pretrain``, then ``finetune`` with ``gpt_step.forward_step``, torch_dist
checkpoints) happen once, in this process, in the ``runs`` fixture (``tests.support.bridge_runs``); the
tests assert on what they recorded through Bridge's callbacks and a metered forward step
(``megatron_bridge_ext.testing.bridge``).
Our LoRA comes in exactly as the docs tell users: ``MemoryConfig(...).apply(cfg)`` on a config
whose ``cfg.peft`` is Bridge's LoRA.

Expected numbers come from shapes (saved bytes, recompute counts), from Bridge's own LoRA (bitwise
where the arithmetic is the same), or from a float64 run of Bridge's LoRA from the same checkpoint
(``shard_local``, whose sums are ordered differently: see ``tests.support.bridge_runs.fp32_bound``).
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_bridge_ext.testing.bridge import recipe
from tests.support.bridge_runs import (
    USER_ALLOCATOR_OPTION,
    Outcome,
    Planned,
    allocator_problems,
    last,
    loop_problems,
    outcome_of,
    rel_diff,
    run_all,
    scalar_tolerance,
    shard_local_gradient_problems,
    shard_local_scalar_problems,
)
from tests.support.bridge_session import bridge_session, shared_directory
from tests.support.dist_checks import assert_no_problems

pytestmark = [pytest.mark.functional, pytest.mark.filterwarnings("ignore:.*torch\\.distributed.*:FutureWarning")]

ROOT = Path(__file__).resolve().parents[2]
RESUME_STEP = 2
FINETUNE_ITERATIONS = 4
MICRO_BATCHES = 2  # global batch 4 = 2 micro-batches of 2 (data-parallel size 1)
FP32 = torch.finfo(torch.float32)


def plan(directory: str) -> list[Planned]:
    base = f"{directory}/base"

    def finetune(save=None, load=None, dtype=None):
        return lambda: recipe.finetune_config(
            base, train_iters=FINETUNE_ITERATIONS, save=save and f"{directory}/{save}",
            load=load and f"{directory}/{load}", ckpt_step=RESUME_STEP if load else None, dtype=dtype)

    regather, shard_local = dict(sequence_parallel_input_strategy="regather"), dict(sequence_parallel_input_strategy="shard_local")
    return [
        Planned("base", "pretrain", lambda: recipe.pretrain_config(base)),
        Planned("bridge", "finetune", finetune(save="bridge"), meter=True),
        Planned("regather", "finetune", finetune(save="regather"), regather, meter=True,
                user_env_vars=dict([USER_ALLOCATOR_OPTION])),
        Planned("shard_local", "finetune", finetune(save="shard_local"), shard_local, meter=True),
        Planned("shard_local+core_attn", "finetune", finetune(),
                dict(sequence_parallel_input_strategy="shard_local", recompute_modules=["core_attn"]), meter=True),
        # resumed at iteration 2 from a LoRA checkpoint: iterations 3 and 4
        Planned("bridge <- bridge", "finetune", finetune(load="bridge"), keep_gradients=True),
        Planned("shard_local <- shard_local", "finetune", finetune(load="shard_local"), shard_local),
        Planned("regather <- bridge", "finetune", finetune(load="bridge"), regather),
        Planned("bridge <- regather", "finetune", finetune(load="regather")),
        Planned("shard_local <- bridge", "finetune", finetune(load="bridge"), shard_local, keep_gradients=True),
        Planned("bridge <- shard_local", "finetune", finetune(load="shard_local")),
        Planned("float64 bridge <- bridge", "finetune", finetune(load="bridge", dtype=torch.float64),
                keep_gradients=True, unclipped=True),
    ]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return shared_directory(str(tmp_path_factory.mktemp("bridge_loop")))


@pytest.fixture(scope="module")
def runs(directory) -> dict[str, Outcome]:
    return run_all(plan(directory))


# --------------------------------------------------------------------------------------------
# The loop runs, with our LoRA in it
# --------------------------------------------------------------------------------------------

def test_bridge_pretrains_fine_tunes_and_resumes_for_every_lora(runs):
    applied = {"regather": "regather", "shard_local": "shard_local"}
    assert_no_problems(loop_problems(runs, plan(""), applied), dist.group.WORLD)


def test_regather_matches_bridge_lora_bitwise(runs):
    bridge, regather = outcome_of(runs, "bridge"), outcome_of(runs, "regather")
    problems = []
    if (regather.losses(), regather.grad_norms()) != (bridge.losses(), bridge.grad_norms()):
        problems.append(f"regather {regather.losses()} {regather.grad_norms()} vs Bridge's LoRA "
                        f"{bridge.losses()} {bridge.grad_norms()}")
    if len(set(bridge.grad_norms())) < 2:
        problems.append(f"Bridge's grad norms do not change: {bridge.grad_norms()}")  # nothing trained
    assert_no_problems(problems, dist.group.WORLD)


def test_shard_local_gradients_are_within_fp32_rounding_of_a_float64_run(runs):
    assert_no_problems(shard_local_gradient_problems(runs), dist.group.WORLD)


def test_shard_local_losses_and_grad_norms_match_bridges_lora_within_the_fp32_bound(runs):
    assert_no_problems(shard_local_scalar_problems(runs), dist.group.WORLD)


# --------------------------------------------------------------------------------------------
# Memory and recompute, measured inside Bridge's loop
# --------------------------------------------------------------------------------------------

def _lora_a_bytes(saved) -> dict[str, int]:
    """Bytes saved by each LoRA-A, keyed by its target (``linear_qkv`` ...) and layer."""
    out = {}
    for name, nbytes in saved.by_module.items():
        if name.endswith("adapter.linear_in"):
            parts = name.split(".")
            out[f"{parts[parts.index('layers') + 1]}.{parts[-3]}"] = nbytes
    return out


def test_lora_a_input_saving_inside_bridges_loop_is_exact(runs):
    cfg = recipe.tiny_recipe(train_iters=1)
    s, b, h = cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size
    t, ffn, layers, element = cfg.model.tensor_model_parallel_size, 4 * h, cfg.model.num_layers, FP32.bits // 8
    row_parallel = {"linear_proj": s * b * (h // t) * element, "linear_fc2": s * b * (ffn // t) * element}
    problems = []
    for name, gathered in (("bridge", True), ("regather", False), ("shard_local", False)):
        run = outcome_of(runs, name)
        column = s * b * h * element // (1 if gathered else t)  # LoRA-A of linear_qkv / linear_fc1
        expected = {f"{layer}.{target}": row_parallel.get(target, column)
                    for layer in range(layers) for target in recipe.LORA_TARGETS}
        if len(run.saved) != FINETUNE_ITERATIONS * MICRO_BATCHES:
            problems.append(f"{name}: {len(run.saved)} metered forwards")
        for index, saved in enumerate(run.saved):
            if _lora_a_bytes(saved) != expected:
                problems.append(f"{name} forward {index}: {_lora_a_bytes(saved)} != {expected}")
    bridge, ours = outcome_of(runs, "bridge").saved[-1], outcome_of(runs, "shard_local").saved[-1]
    saving = layers * 2 * s * b * h * element * (t - 1) // t  # two column-parallel adapters per layer
    if bridge.total_bytes - ours.total_bytes != saving:
        problems.append(f"total saved {bridge.total_bytes} -> {ours.total_bytes}, expected a saving of {saving}")
    assert_no_problems(problems, dist.group.WORLD)


def test_core_attn_recompute_runs_in_bridges_loop_and_changes_no_number(runs):
    layers = recipe.tiny_recipe(train_iters=1).model.num_layers
    recomputed, plain = outcome_of(runs, "shard_local+core_attn"), outcome_of(runs, "shard_local")
    per_step = {"checkpointed_forwards": layers * MICRO_BATCHES, "recomputed": layers * MICRO_BATCHES}
    problems = [f"shard_local+core_attn iteration {s.iteration}: {s.recompute} != {per_step}"
                for s in recomputed.steps if s.recompute != per_step]
    problems += [f"shard_local iteration {s.iteration}: {s.recompute} without recompute"
                 for s in plain.steps if any(s.recompute.values())]
    if (recomputed.losses(), recomputed.grad_norms()) != (plain.losses(), plain.grad_norms()):
        problems.append(f"recompute changed the numbers: {recomputed.losses()} vs {plain.losses()}")
    attention = [r.saved[-1].by_category.get("attention", 0) for r in (plain, recomputed)]
    if not attention[1] < attention[0]:
        problems.append(f"attention saved bytes {attention[0]} -> {attention[1]} with core_attn recompute")
    assert_no_problems(problems, dist.group.WORLD)


def test_allocator_variables_from_cfg_env_vars_are_in_the_ranks_environment(runs):
    outcome_of(runs, "regather")  # its recipe keeps an allocator option of its own (USER_ALLOCATOR_OPTION)
    assert_no_problems(allocator_problems(runs["regather"]), dist.group.WORLD)


# --------------------------------------------------------------------------------------------
# torch_dist checkpoints: resume and cross-resume
# --------------------------------------------------------------------------------------------

def test_resuming_from_a_lora_checkpoint_reproduces_the_uninterrupted_run_exactly(runs):
    problems = []
    for resumed, uninterrupted in (("bridge <- bridge", "bridge"), ("shard_local <- shard_local", "shard_local"),
                                   ("regather <- bridge", "bridge"), ("bridge <- regather", "regather")):
        got, want = last(outcome_of(runs, resumed), 2), last(outcome_of(runs, uninterrupted), 2)
        if got != want:
            problems.append(f"{resumed}: {got} != {uninterrupted} iterations 3-4 {want}")
    assert_no_problems(problems, dist.group.WORLD)


def test_checkpoints_cross_between_bridges_lora_and_shard_local(runs):
    bound = scalar_tolerance(runs)
    pairs = (("shard_local <- bridge", "bridge <- bridge"), ("bridge <- shard_local", "shard_local <- shard_local"))
    problems = []
    for cross, same in pairs:
        got, want = outcome_of(runs, cross), outcome_of(runs, same)
        error = max(rel_diff(got.losses(), want.losses()), rel_diff(got.grad_norms(), want.grad_norms()))
        if error > bound:
            problems.append(f"{cross} vs {same}: {error:.3g} > {bound:.3g}")
    assert_no_problems(problems, dist.group.WORLD)


# --------------------------------------------------------------------------------------------
# The docs' example (docs/tools/bridge-loop.md), as written
# --------------------------------------------------------------------------------------------

def docs_example() -> str:
    text = (ROOT / "docs" / "tools" / "bridge-loop.md").read_text()
    match = re.search(r"```python\n(# finetune_lora\.py.*?)```", text, re.S)
    assert match, "docs/tools/bridge-loop.md lost its Bridge example (a python block starting with '# finetune_lora.py')"
    return match.group(1)


def run_script(script: Path, argv: list[str]) -> None:
    """Run ``script`` as ``python script ARGV...`` would, in this process (the ranks are already up)."""
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved


def test_the_docs_example_runs_as_written_and_trains_as_the_recipe_run(runs, directory, tmp_path):
    expected = outcome_of(runs, "shard_local+core_attn").losses()
    script = tmp_path / "finetune_lora.py"
    script.write_text(docs_example())
    output, error = io.StringIO(), None
    with bridge_session() as session, contextlib.redirect_stdout(output):
        try:
            session.next_run()
            run_script(script, [f"{directory}/base", f"{directory}/docs_example"])
        except Exception:
            error = traceback.format_exc(limit=-8)
    text = output.getvalue()
    problems = [f"the example failed:\n{error}"] if error else []
    if "peft.sequence_parallel_input_strategy: 'off' -> 'shard_local'" not in text:
        problems.append("the example did not print MemoryConfig's summary")
    if dist.get_rank() == dist.get_world_size() - 1:  # Bridge prints its training log on the last rank
        printed = re.findall(r"lm loss: ([0-9.E+-]+)", text)
        if printed != [f"{loss:E}" for loss in expected]:
            problems.append(f"the example's losses {printed} != the recipe run's {expected}")
    assert_no_problems(problems, dist.group.WORLD)


def test_a_session_leaves_our_warnings_visible_after_bridges_logging_setup(directory, caplog):
    """Bridge's setup calls ``setup_logging`` with ``logger.filter_warnings`` (True by default), which puts a
    filter dropping every WARNING record on the root logger and on every logger that exists, ours included;
    after the session a warning of our patches must reach the logging system again."""
    import logging

    logger = logging.getLogger("megatron_bridge_ext.patches")
    with bridge_session():
        from megatron.bridge.training.utils.log_utils import setup_logging  # the session imports Bridge without TE

        setup_logging(filter_warning=True)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("seen after the session")
    seen = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert_no_problems([] if seen == ["seen after the session"] else [f"records after the session: {seen}"],
                       dist.group.WORLD)
