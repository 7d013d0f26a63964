"""``moe_act`` recompute: the routed experts' activation recomputed in backward, as Core's ``TEGroupedMLP`` does it.

Core recomputes ``moe_act`` only in ``TEGroupedMLP`` (``transformer/moe/experts.py`` L268-271; the grouped GEMM of
Transformer Engine, which ``moe_act`` requires): ``linear_fc1`` runs as usual, the activation (with the routing
probabilities) runs inside ``CheckpointWithoutOutput`` without grad (L882-886), which keeps the activation's inputs,
fc1's output and the probabilities (``tensor_parallel/random.py`` L702-704); ``linear_fc2`` keeps its input, the
activation's output, whose storage Core then releases (``discard_output_and_register_recompute``, L892-893;
``random.py`` L830-848) and makes again in backward. So per routed token the experts keep fc1's input, fc1's
output and the probability, and none of what the activation saves inside nor fc2's input.

The local spec's ``SequentialMLP`` (what the estimate traces) runs each local expert as Core's ``MLP``, which ignores
``moe_act``. While tracing, :class:`ActivationRecomputedExpert` takes ``MLP``'s place as SequentialMLP's expert: the
same module (its linears, its parameters, Core's own activation code, ``mlp.py`` L258-346) run as TEGroupedMLP runs
its activation, so that the meter counts what TEGroupedMLP keeps, one expert's tokens at a time (the same bytes as
TEGroupedMLP's concatenated tokens).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from megatron_bridge_ext.findings import ERROR, Finding

MODULE = "moe_act"


def used(model) -> bool:
    return bool(getattr(model, "num_moe_experts", None) and getattr(model, "recompute_granularity", None) == "selective"
                and MODULE in (getattr(model, "recompute_modules", None) or []))


def findings(model) -> list[Finding]:
    """With FP8, TEGroupedMLP has ``linear_fc2`` keep its original (high-precision) input for the recompute
    (``set_save_original_input``, experts.py L272-275), a variant the estimate does not model."""
    if not (used(model) and getattr(model, "fp8", None)):
        return []
    return [Finding("unsupported_model", ERROR, "model.recompute_modules",
                    "moe_act recompute under FP8 is not modelled by the estimate (Transformer Engine's grouped fc2 "
                    "then keeps its high-precision input)", "estimate without moe_act, or the bf16 config")]


def _expert_class():
    from megatron.core.tensor_parallel import CheckpointWithoutOutput
    from megatron.core.transformer.mlp import MLP

    class ActivationRecomputedExpert(MLP):
        """Core's ``MLP`` as a routed expert whose activation runs as ``TEGroupedMLP`` runs it under ``moe_act``
        recompute: inside ``CheckpointWithoutOutput``, fc2's input released after fc2 (experts.py L882-893)."""

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            fc1_output, bias = self.linear_fc1(hidden_states)
            checkpoint = CheckpointWithoutOutput()
            activated = checkpoint.checkpoint(self._activation, fc1_output, bias, per_token_scale)
            output, output_bias = self.linear_fc2(activated)
            checkpoint.discard_output_and_register_recompute(output)
            return output, output_bias

        def _activation(self, fc1_output, bias, per_token_scale):
            """Core's own activation of ``MLP.forward`` (``mlp.py`` L267-337) on ``fc1_output``: its linears passed
            through for the call."""
            linears = self.linear_fc1, self.linear_fc2
            self.linear_fc1, self.linear_fc2 = _given(fc1_output, bias), _given(None, None)
            try:
                return MLP.forward(self, None, per_token_scale)[0]
            finally:
                self.linear_fc1, self.linear_fc2 = linears

    return ActivationRecomputedExpert


def _given(output, bias):
    """A module standing in for a linear: it returns ``output`` (its input when None) and ``bias``."""
    import torch

    class Given(torch.nn.Module):
        def forward(self, x):
            return (x if output is None else output), bias

    return Given()


@contextlib.contextmanager
def te_grouped_recompute(model) -> Iterator[None]:
    """While ``model``'s layers are built: SequentialMLP's experts are :class:`ActivationRecomputedExpert` under
    ``moe_act`` recompute (``experts.py`` L1293, which builds ``MLP`` by name); put back on exit."""
    if not used(model):
        yield
        return
    from megatron.core.transformer.moe import experts

    saved = experts.MLP
    experts.MLP = _expert_class()
    try:
        yield
    finally:
        experts.MLP = saved
