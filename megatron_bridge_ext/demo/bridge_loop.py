"""Megatron Bridge's own training loop on a tiny GPT, with Bridge's LoRA and ours: ``mbx demo --bridge``.

Every run goes through Bridge's real entry points, ``pretrain``/``finetune`` with
``gpt_step.forward_step``: Bridge's setup, DDP, optimizer, PEFT hooks and torch_dist checkpoints.
What this module adds only observes, through Bridge's own extension points:

* :class:`StepRecorder`: Bridge callbacks (``on_train_step_start``/``on_train_step_end``) record
  each iteration's loss (``lm loss`` as Bridge reduces it), the grad norm the optimizer returned,
  the rank's environment for the variables of ``cfg.env_vars``, and the counts of a
  :class:`~megatron_bridge_ext.levers.recompute.probe.RecomputeProbe` held over the whole step.
* :class:`MeteredForwardStep`: Bridge's ``forward_step`` with a
  :class:`~megatron_bridge_ext.measure.SavedActivationMeter` around each micro-batch's forward
  (the model forward runs inside ``forward_step``; Core's schedule runs backward afterwards).

:func:`tiny_gpt` shrinks a Bridge GPT recipe to a 2-layer model that runs in seconds on 2 CPU ranks
(fp32 so that Bridge's LoRA and ours compare exactly, Megatron Core's local layer spec, TP=2 with
sequence parallelism). The tests and ``mbx demo --bridge`` use it; so does the README's example.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from typing import Optional

LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_RANK, LORA_ALPHA = 8, 16
BASE_ITERATIONS = 2  # pretraining steps that make the base checkpoint LoRA fine-tunes from
SAVE_INTERVAL = 2
TENSOR_PARALLEL = 2  # = ranks started by mbx demo --bridge
LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 2, 64, 4, 32, 256
FFN = 4 * HIDDEN  # Megatron Core's default ffn_hidden_size
MICRO_BATCH, GLOBAL_BATCH = 2, 4

FP32_UNIT_ROUNDOFF = 2.0 ** -24


def _gamma(terms: int) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative change of a sum of n fp32 terms of one sign when its
    order changes (Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1 and section 4.2)."""
    return terms * FP32_UNIT_ROUNDOFF / (1 - terms * FP32_UNIT_ROUNDOFF)


def rounding_bounds() -> dict[str, float]:
    """Relative bounds on how much the printed loss and grad norm may differ between CPUs (their BLAS and SIMD
    kernels sum in other orders), to first order: gamma of the terms summed along the longest chain behind the figure.

    Loss: per layer the norm (h), linear_qkv (h), the scores (h / heads), attention x V (s), linear_proj (h/t,
    then t ranks), linear_fc1 (h), linear_fc2 (ffn/t, then t); then the output layer (h), the log-sum-exp over
    the vocabulary (V/t, then t) and the mean over the step's tokens. Grad norm: the backward chain (twice the
    forward one) and its sum of squares over the trainable parameters of both ranks (LoRA A [r, in] and
    B [out, r] of the four targets, split as Megatron splits them). Earlier iterations enter a figure only
    through weight updates scaled by the learning rate, which leaves these bounds unchanged to first order.
    """
    h, t, r = HIDDEN, TENSOR_PARALLEL, LORA_RANK
    per_layer = h + h + h // HEADS + SEQ + (h // t + t) + h + (FFN // t + t)
    forward = LAYERS * per_layer + h + (VOCAB // t + t) + SEQ * GLOBAL_BATCH
    lora = (r * h + 3 * h // t * r) + (r * h // t + h * r) + (r * h + FFN // t * r) + (r * FFN // t + h * r)
    return {"loss": _gamma(forward), "grad_norm": _gamma(2 * forward + t * LAYERS * lora)}


FLOAT_FIGURES = {"losses": "loss", "grad_norms": "grad_norm"}
"""The row fields that depend on the CPU's floating-point kernels, and their bound in :func:`rounding_bounds`."""


def compare_runs(rows: list[dict], reference: list[dict]) -> list[str]:
    """How two runs' rows differ beyond rounding: every exact field (variant, bytes, counts, environment) must be
    equal; losses and grad norms within twice their bound of each other (each is within it of the exact value)."""
    bounds = rounding_bounds()
    problems = []
    if [r["variant"] for r in rows] != [r["variant"] for r in reference]:
        return [f"variants {[r['variant'] for r in rows]} != {[r['variant'] for r in reference]}"]
    for row, ref in zip(rows, reference):
        exact = sorted((set(row) | set(ref)) - set(FLOAT_FIGURES))
        problems += [f"{row['variant']}: {k} {row.get(k)!r} != {ref.get(k)!r}" for k in exact
                     if row.get(k) != ref.get(k)]
        for field, name in FLOAT_FIGURES.items():
            if len(row[field]) != len(ref[field]):
                problems.append(f"{row['variant']}: {len(row[field])} {field} != {len(ref[field])}")
            for i, (a, b) in enumerate(zip(row[field], ref[field]), start=1):
                if a is None or b is None:  # no grad norm reported that iteration: both runs must agree
                    if a is not b:
                        problems.append(f"{row['variant']}: iteration {i} {name} {a!r} vs {b!r}")
                    continue
                allowed = 2 * bounds[name] * max(abs(a), abs(b))
                if abs(a - b) > allowed:
                    problems.append(f"{row['variant']}: iteration {i} {name} {a!r} vs {b!r} differ by "
                                    f"{abs(a - b):.3g} > {allowed:.3g}")
    return problems


def decimals(bound: float, values) -> int:
    """The most decimals whose last digit the bound still supports: 10**-d >= bound * max |value|."""
    import math

    largest = max((abs(v) for v in values if v is not None), default=1.0)
    return max(0, math.floor(-math.log10(bound * largest)))


def tiny_gpt(cfg, *, train_iters: int, dtype=None):
    """Shrink the Bridge GPT recipe ``cfg`` (e.g. ``vanilla_gpt_pretrain_config()``) to the demo's model, in place.

    2 layers, hidden 64, 4 heads (FFN 4h = 256), sequence 32, vocabulary 256; TP=2 with sequence
    parallelism; ``dtype`` for parameters (fp32 by default), no mixed precision, no
    dropout; 2 micro-batches of 2 per iteration; Bridge's mock GPT data; torch_dist checkpoints
    every 2 iterations, saved synchronously. Returns ``cfg``. Applies ``core_local_norm_sequence_parallel``
    (the local spec's norm refuses sequence parallelism upstream).
    """
    import torch
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.training.config import MockGPTDatasetConfig

    from megatron_bridge_ext.patches import core_local_norm_sequence_parallel

    core_local_norm_sequence_parallel.PATCH.apply()
    dtype = dtype or torch.float32
    model = cfg.model
    model.num_layers, model.hidden_size, model.num_attention_heads = LAYERS, HIDDEN, HEADS
    model.seq_length, model.vocab_size = SEQ, VOCAB
    model.transformer_layer_spec = local_layer_spec  # Megatron Core's local spec: runs without TE too
    model.tensor_model_parallel_size, model.sequence_parallel = TENSOR_PARALLEL, True
    model.hidden_dropout = model.attention_dropout = 0.0  # runs that compare LoRA variants stay deterministic
    model.gradient_accumulation_fusion = False
    model.bf16 = model.fp16 = False
    model.params_dtype = model.pipeline_dtype = dtype
    if dtype != torch.float32:  # the local spec builds its norms in fp32 whatever params_dtype says: cast them
        model.register_pre_wrap_hook(lambda chunks: [chunk.to(dtype) for chunk in chunks], prepend=True)
    cfg.mixed_precision = None
    cfg.optimizer.bf16 = cfg.optimizer.fp16 = False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.grad_reduce_in_fp32 = False  # gradients in the parameters' dtype (fp64 runs stay fp64)
    cfg.scheduler.lr_warmup_iters = 0
    cfg.scheduler.lr_decay_iters = cfg.scheduler.lr_wsd_decay_iters = None
    cfg.train.train_iters = train_iters
    cfg.train.global_batch_size, cfg.train.micro_batch_size = GLOBAL_BATCH, MICRO_BATCH
    cfg.validation.eval_iters, cfg.validation.eval_interval = 0, None
    cfg.dataset = MockGPTDatasetConfig(
        seq_length=model.seq_length, random_seed=1234, split="9999,8,2", reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, dataloader_type="single", num_workers=0,
        pin_memory=False, persistent_workers=False)
    cfg.tokenizer.vocab_size = model.vocab_size
    cfg.logger.log_interval, cfg.logger.tensorboard_dir = 1, None
    cfg.checkpoint.ckpt_format, cfg.checkpoint.async_save = "torch_dist", False
    cfg.checkpoint.save_interval = SAVE_INTERVAL
    return cfg


def recipe(*, train_iters: int, dtype=None):
    """Bridge's vanilla GPT recipe, shrunk by :func:`tiny_gpt`."""
    from megatron.bridge.recipes.gpt import vanilla_gpt_pretrain_config

    return tiny_gpt(vanilla_gpt_pretrain_config(), train_iters=train_iters, dtype=dtype)


def bridge_lora():
    """Megatron Bridge's own LoRA on the four linear layers (with ``bridge_truthful_te_detection`` applied)."""
    from megatron.bridge.peft.lora import LoRA

    from megatron_bridge_ext.patches import bridge_truthful_te_detection

    bridge_truthful_te_detection.PATCH.apply()
    return LoRA(target_modules=list(LORA_TARGETS), dim=LORA_RANK, alpha=LORA_ALPHA)


def pretrain_config(save: str):
    """The base model: :data:`BASE_ITERATIONS` pretraining steps, saved to ``save``."""
    cfg = recipe(train_iters=BASE_ITERATIONS)
    cfg.checkpoint.save, cfg.checkpoint.save_interval = save, BASE_ITERATIONS
    return cfg


def finetune_config(pretrained: str, *, train_iters: int = 4, save: Optional[str] = None, load: Optional[str] = None,
                    ckpt_step: Optional[int] = None, dtype=None):
    """LoRA fine-tuning of the base model with Bridge's LoRA (apply a MemoryConfig for ours)."""
    cfg = recipe(train_iters=train_iters, dtype=dtype)
    cfg.checkpoint.pretrained_checkpoint = pretrained
    cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.ckpt_step = save, load, ckpt_step
    cfg.peft = bridge_lora()
    return cfg


@dataclasses.dataclass
class Step:
    """One training iteration as this rank saw it."""

    iteration: int
    loss: float
    grad_norm: Optional[float]
    environment: dict[str, Optional[str]]  # os.environ[name] for every name of cfg.env_vars
    recompute: dict[str, int]  # RecomputeProbe counts over the whole step (forward and backward)
    dtypes: list[str]  # of the model's parameters
    gradients: Optional[dict] = None  # trainable parameter -> this rank's gradient (float64 copy), when kept


class StepRecorder:
    """Bridge callbacks that record each iteration (see :class:`Step`).

    ``keep_gradients``: also copy each trainable parameter's gradient as the optimizer used it
    (Megatron Core's ``main_grad``, reduced over the tensor-parallel group where needed).
    """

    def __init__(self, *, keep_gradients: bool = False) -> None:
        self.steps: list[Step] = []
        self._keep_gradients = keep_gradients
        self._probe = None

    def callbacks(self):
        from megatron.bridge.training.callbacks import CallbackManager

        manager = CallbackManager()
        manager.register("on_train_step_start", self._start)
        manager.register("on_train_step_end", self._end)
        return manager

    def _start(self, context) -> None:
        from megatron_bridge_ext.levers.recompute.probe import RecomputeProbe

        self._probe = RecomputeProbe(context.model[0])
        self._probe.__enter__()

    def close(self) -> None:
        """Remove the probe of a step that did not end (the run failed inside it)."""
        if self._probe is not None:
            self._probe.__exit__(None, None, None)
            self._probe = None

    def _end(self, context) -> None:
        recompute = self._probe.as_dict()
        self.close()
        env_vars = getattr(context.state.cfg, "env_vars", None) or {}
        model = context.model[0]
        self.steps.append(Step(
            iteration=context.state.train_state.step + 1,  # Bridge counts the step after this event
            loss=float(context.loss_dict["lm loss"]),
            grad_norm=None if context.grad_norm is None else float(context.grad_norm),
            environment={name: os.environ.get(name) for name in env_vars},
            recompute=recompute,
            dtypes=sorted({str(p.dtype) for p in model.parameters()}),
            gradients={name: getattr(p, "main_grad", p.grad).detach().double().clone()
                       for name, p in model.named_parameters() if p.requires_grad} if self._keep_gradients else None,
        ))


class MeteredForwardStep:
    """Bridge's ``forward_step`` with a SavedActivationMeter around each micro-batch's forward.

    Bridge hands a functor the GlobalState when its first parameter is named ``state``.
    """

    def __init__(self, forward_step) -> None:
        self._forward_step = forward_step
        self.saved: list = []  # SavedActivations, one per micro-batch forward

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False):
        from megatron_bridge_ext.measure import SavedActivationMeter

        with SavedActivationMeter(model) as meter:
            output = self._forward_step(state, data_iterator, model, return_schedule_plan)
        self.saved.append(meter.result())
        return output


@dataclasses.dataclass
class Run:
    """What one pretrain/finetune call recorded on this rank."""

    steps: list[Step]
    saved: list  # SavedActivations per micro-batch forward; empty when not metered

    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    def grad_norms(self) -> list[Optional[float]]:
        return [s.grad_norm for s in self.steps]


def run(entry: str, cfg, *, meter: bool = False, keep_gradients: bool = False) -> Run:
    """Call Bridge's ``pretrain`` or ``finetune`` (``entry``) on ``cfg`` with ``gpt_step.forward_step``."""
    from megatron.bridge.training.gpt_step import forward_step

    if entry == "pretrain":
        from megatron.bridge.training.pretrain import pretrain as bridge_entry
    else:
        from megatron.bridge.training.finetune import finetune as bridge_entry
    recorder = StepRecorder(keep_gradients=keep_gradients)
    step = MeteredForwardStep(forward_step) if meter else forward_step
    try:
        bridge_entry(cfg, step, callbacks=recorder.callbacks())
    finally:
        recorder.close()
    return Run(recorder.steps, step.saved if meter else [])


# ------------------------------------------------------------------------------------------------
# mbx demo --bridge
# ------------------------------------------------------------------------------------------------

VARIANTS = (
    ("Bridge LoRA", None),
    ("shard_local", dict(lora_sp_input="shard_local")),
    ("shard_local+core_attn", dict(lora_sp_input="shard_local", recompute_modules=["core_attn"])),
)


def _steps(text: str) -> int:
    from megatron_bridge_ext.demo.options import _positive_int

    value = _positive_int(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"{value} is more than 100 (this is a demo: a few steps show the numbers)")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mbx demo --bridge", description="LoRA fine-tuning of a tiny GPT through Megatron Bridge's own "
        "pretrain/finetune loop: Bridge's LoRA and ours (MemoryConfig) side by side, memory measured inside the loop")
    p.add_argument("--steps", type=_steps, default=4, help="fine-tuning iterations per variant (1-100)")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="keep the checkpoints in DIR (DIR/base is the base model the README's finetune_lora.py "
                        "example fine-tunes); default: a temporary directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(tp=TENSOR_PARALLEL)  # ranks started
    return p


def _variant_config(base: str, steps: int, memory: Optional[dict]):
    from megatron_bridge_ext.config import MemoryConfig

    cfg = finetune_config(base, train_iters=steps)
    if memory is not None:
        MemoryConfig(**memory).apply(cfg)
    return cfg


def _rows(name: str, result: Run) -> dict:
    last = result.saved[-1]
    lora_inputs = {k: v for k, v in last.by_module.items() if last.module_categories.get(k) == "lora_input"}
    return {
        "variant": name,
        "losses": result.losses(),
        "grad_norms": result.grad_norms(),
        "saved_bytes": last.total_bytes,
        "lora_input_bytes": last.module_bytes("lora_input"),
        "attention_bytes": last.by_category.get("attention", 0),
        "lora_input_by_module": lora_inputs,
        "core_attn_recompute": result.steps[-1].recompute,
        "environment": result.steps[-1].environment,
    }


def format_tables(rows: list[dict]) -> str:
    from megatron_bridge_ext.table import text_table

    steps = range(1, len(rows[0]["losses"]) + 1)
    bounds = rounding_bounds()
    d_loss = decimals(bounds["loss"], [v for r in rows for v in r["losses"]])
    d_norm = decimals(bounds["grad_norm"], [v for r in rows for v in r["grad_norms"]])
    losses = text_table(["iteration"] + [r["variant"] for r in rows],
                        [[str(i)] + [f"{r['losses'][i - 1]:.{d_loss}f} / {r['grad_norms'][i - 1]:.{d_norm}f}"
                                     for r in rows] for i in steps])
    memory = text_table(
        ["variant", "saved/micro-batch", "LoRA-A inputs", "attention", "core_attn ckpt/recomputed per step"],
        [[r["variant"], f"{r['saved_bytes']:,} B", f"{r['lora_input_bytes']:,} B", f"{r['attention_bytes']:,} B",
          "{checkpointed_forwards}/{recomputed}".format(**r["core_attn_recompute"])] for r in rows])
    env = "; ".join(f"{k}={v!r}" for k, v in rows[-1]["environment"].items() if "ALLOC" in k)
    return ("Megatron Bridge pretrain + finetune (tiny GPT: 2 layers, hidden 64, seq 32, TP=2 + SP, fp32; LoRA r=8 "
            "on qkv/proj/fc1/fc2)\n\nloss / grad norm per iteration (rank 0):\n" + losses
            + "\n\nsaved activations per micro-batch forward, inside Bridge's forward_step (rank 0):\n" + memory
            + f"\n\nallocator variables in the ranks' environment (from cfg.env_vars): {env or '(none)'}")


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: pretrain the base, fine-tune each variant through Bridge's loop, print on rank 0.

    Bridge's own log goes to stderr, so that stdout holds the tables (or the JSON) only.
    """
    import torch.distributed as dist

    import megatron_bridge_ext
    from megatron_bridge_ext.demo import distributed

    megatron_bridge_ext.init()
    if not dist.is_initialized():  # ours: Bridge then leaves the process group alive between runs
        dist.init_process_group(backend=distributed.backend_for_device(), timeout=distributed.DEFAULT_TIMEOUT)
    rank = dist.get_rank()
    with contextlib.ExitStack() as stack:
        local = os.path.abspath(args.keep) if args.keep else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="mbx-bridge-demo-"))
        shared = [local if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        base = os.path.join(shared[0], "base")
        with contextlib.redirect_stdout(sys.stderr):
            run("pretrain", pretrain_config(base))
            rows = [_rows(name, run("finetune", _variant_config(base, args.steps, memory), meter=True))
                    for name, memory in VARIANTS]
        dist.barrier()  # rank 0 removes a temporary directory on exit
    if rank == 0:
        print(json.dumps({"rows": rows}, indent=2) if args.json else format_tables(rows), flush=True)
        if args.keep:
            print(f"base checkpoint kept in {base}", file=sys.stderr)
    dist.destroy_process_group()


def _nothing_to_check(args: argparse.Namespace) -> None:
    """argparse already refuses every bad value of this demo's options."""


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_bridge_ext.demo import launch

    argv = list(sys.argv[1:] if argv is None else argv)
    return launch.run("mbx demo --bridge", "megatron_bridge_ext.demo.bridge_loop", parser(), argv, worker,
                      check=_nothing_to_check, bridge=True)


if __name__ == "__main__":
    sys.exit(main())
