"""A plan built by hand from the real dataclasses, without Bridge or torch: what the rendering tests print.

Every byte count is a whole number of 10^8 bytes, so that Bridge's GB figures (5 significant digits) are exact
and a test can write each phase's peak as a sum of the components it holds.
"""

from __future__ import annotations

from types import SimpleNamespace

from megatron_bridge_ext.estimate import phases
from megatron_bridge_ext.estimate.report import ACTIVATIONS, BUFFERS, STATIC, TRANSIENT, Component, MemoryEstimate
from megatron_bridge_ext.estimate.settings import Settings
from megatron_bridge_ext.levers import steptime
from megatron_bridge_ext.levers.step import Option
from tests.support.settings import gpt_stage, lora

G = 10**9
WEIGHTS, GRADIENTS, MASTERS, MOMENTS = 4 * G, 8 * G, 4 * G, 8 * G
ACTIVATION, BUFFER, LARGEST, SMALLER, STEP_COPIES = 6 * G, G // 10, G // 2, G // 5, 2 * G
STATIC_BYTES = WEIGHTS + GRADIENTS + MASTERS + MOMENTS
ITERATION_1_PEAK = STATIC_BYTES - MOMENTS + ACTIVATION + BUFFER + LARGEST  # no moments before the first step
FIRST_STEP_PEAK = STATIC_BYTES + BUFFER + STEP_COPIES  # activations freed, the step's copies alive
STEADY_PEAK = STATIC_BYTES + ACTIVATION + BUFFER + LARGEST
AFTER_STEP = STATIC_BYTES + BUFFER  # what a report after a step holds (the copies are not kept here)

SETTINGS = gpt_stage(tp=2, pp=1, vpp=None, dp=2, cp=1, sequence_parallel=True, seq_length=4096, micro_batch=1,
                     num_microbatches=4, dtype="bfloat16", fp8=None,
                     peft=lora(16, ["linear_qkv", "linear_fc1"], strategy="off"), recompute_granularity=None,
                     attention="fused", transformer_impl="local")
"""A dense LoRA config on TP 2, DP 2: the first stage's reports are printed by ranks 0 and 1."""


def estimate(settings: Settings | None = None) -> MemoryEstimate:
    step = phases.StepState(MASTERS, MOMENTS, masters_in_step=False,
                            transients=(Component(TRANSIENT, phases.FP32_GRAD_COPIES, STEP_COPIES, "copies"),))
    components = [Component(STATIC, "weights: transformer layers", WEIGHTS, "weights basis"),
                  Component(STATIC, "gradients (main_grad buffer)", GRADIENTS, "gradients basis"),
                  Component(STATIC, phases.OPTIMIZER_STATES, MASTERS + MOMENTS, "optimizer basis"),
                  Component(ACTIVATIONS, "mlp", ACTIVATION, "activations basis"),
                  Component(BUFFERS, "global memory buffer", BUFFER, "buffer basis"),
                  Component(TRANSIENT, "logits at the loss", LARGEST, "loss basis"),
                  Component(TRANSIENT, "layer backward", SMALLER, "backward basis")]
    return MemoryEstimate(stage=0, components=components, settings=settings or SETTINGS,
                          assumptions=["an assumption of the estimate"], activations_per_microbatch={},
                          in_flight_microbatches=1.0, seconds=1.25, step=step)


def option(step: int, label: str, peak: int, usable: int, **fields) -> Option:
    return Option(step=step, lever=f"lever {step}", label=label, applicable=True, peak_bytes=peak,
                  usable_bytes=usable, **fields)


def plan(gpu_memory: int, *, margin: float = 0.10, options: tuple = (), **fields) -> SimpleNamespace:
    """A result with every attribute of :class:`megatron_bridge_ext.planner.Plan` that the text reads, on
    :func:`estimate`; ``fields`` replace any of them (``baseline=None``: a plan without our estimate)."""
    usable = int(gpu_memory * (1 - margin))
    est = estimate()
    options = list(options)
    result = SimpleNamespace(gpu_memory=gpu_memory, margin=margin, expandable_margin=0.03, expandable_segments=False,
                             usable_now=usable, baseline=est, bridge=None, bridge_error=None, options=options,
                             notes=[], refused=None, layout={}, not_modelled=[], gpu=steptime.gpu(),
                             step_time=steptime.StepTime(1.0, 0.25, 0.0, 0.0, 0.0, 0.125, 0.0), strategies=[],
                             fits_as_is=est.peak_bytes <= usable, chosen=next((o for o in options if o.fits), None))
    vars(result).update(fields)
    return result
