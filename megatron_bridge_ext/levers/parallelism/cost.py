"""What resizing TP or PP costs in the plan: the activation traffic one rank moves per step."""

from __future__ import annotations

BASIS = ("formula: TP 8*s*b*h*e*(t-1)/t per layer and microbatch, PP 2*(s/t)*b*h*e per microbatch, on this rank's "
         "layers, with twice the microbatches per step as DP halves")


def tp_collective_bytes(s: dict, *, tp: int, layers: int, num_microbatches: int, element: int) -> int:
    """Bytes one rank moves per step for tensor parallelism's activations: per layer and microbatch,
    2 all-gathers and 2 reduce-scatters of [s, b, h] forward and as many backward (all-reduces
    without SP: the same volume), each moving (t - 1) / t of the tensor from a rank."""
    if tp == 1:
        return 0
    sbh = s["seq_length"] * s["micro_batch"] * s["hidden"]
    return 8 * sbh * element * (tp - 1) * layers * num_microbatches // tp


def p2p_bytes(s: dict, *, pp: int, tp: int, num_microbatches: int, element: int) -> int:
    """Bytes a pipeline stage sends per step: its output activation forward and its input's gradient
    backward, [s/t, b, h] under SP, per microbatch (none with PP = 1)."""
    if pp == 1:
        return 0
    seq = s["seq_length"] // tp if s["sequence_parallel"] else s["seq_length"]
    return 2 * seq * s["micro_batch"] * s["hidden"] * element * num_microbatches


def traffic_change(before: dict, after: dict, element: int) -> tuple[int, str]:
    """Change in TP and PP traffic per step from the estimate settings ``before`` to ``after``, with its basis."""

    def volume(s):
        return (tp_collective_bytes(s, tp=s["tp"], layers=s["layers_on_stage"], num_microbatches=s["num_microbatches"],
                                    element=element)
                + p2p_bytes(s, pp=s["pp"], tp=s["tp"], num_microbatches=s["num_microbatches"], element=element))

    return volume(after) - volume(before), BASIS
