"""core_local_norm_sequence_parallel: Core's local spec's norm under sequence parallelism."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.patches.base import APPLIED
from tests.support.fresh import run

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# core_local_norm_sequence_parallel: the local spec's norm under sequence parallelism
# --------------------------------------------------------------------------------------------

# TP=2 in the config only: building a norm needs no process group.
NORM_SETUP = """
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN = 16


def config(sequence_parallel, **fields):
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, tensor_model_parallel_size=2,
                             sequence_parallel=sequence_parallel, use_cpu_initialization=True, **fields)


def build(cfg):
    '''(norm, None) or (None, the AssertionError's text).'''
    try:
        return WrappedTorchNorm(cfg, HIDDEN), None
    except AssertionError as exc:
        return None, str(exc) or "AssertionError"


def describe(norm):
    return {
        "type": type(norm).__name__,
        "shape": list(norm.normalized_shape),
        "eps": norm.eps,
        "sequence_parallel": [getattr(p, "sequence_parallel", None) for p in norm.parameters()],
        "state": {k: v.tolist() for k, v in norm.state_dict().items()},
    }
"""


def test_upstream_local_norm_refuses_sequence_parallel():
    result = run(NORM_SETUP, """
        norm, error = build(config(True))
        report(error=error)
    """)
    assert result["error"] is not None, "upstream WrappedTorchNorm was expected to assert under SP"
    assert "sequence parallel" in result["error"]


def test_patched_local_norm_builds_under_sequence_parallel_and_revert_restores_upstream():
    result = run(NORM_SETUP, """
        from megatron_bridge_ext.patches import core_local_norm_sequence_parallel

        original_new = WrappedTorchNorm.__dict__["__new__"]
        upstream_plain, _ = build(config(False))
        status = core_local_norm_sequence_parallel.PATCH.apply()

        sp_config = config(True)
        layer_norm, layer_norm_error = build(sp_config)
        rms_norm, rms_error = build(config(True, normalization="RMSNorm"))
        patched_plain, _ = build(config(False))
        persist_config = config(True, persist_layer_norm=True)
        _, persist_error = build(persist_config)

        core_local_norm_sequence_parallel.PATCH.revert()
        _, error_after_revert = build(config(True))
        report(
            status=status[0],
            layer_norm_error=layer_norm_error, layer_norm=describe(layer_norm), config_sp_after=sp_config.sequence_parallel,
            rms_error=rms_error, rms_norm=describe(rms_norm),
            upstream_plain=describe(upstream_plain), patched_plain=describe(patched_plain),
            persist_error=persist_error, persist_config_sp_after=persist_config.sequence_parallel,
            new_restored=WrappedTorchNorm.__dict__["__new__"] is original_new, error_after_revert=error_after_revert,
        )
    """)
    assert result["status"] == APPLIED
    assert result["layer_norm_error"] is None
    assert result["layer_norm"]["type"] == "LayerNorm" and result["layer_norm"]["shape"] == [16]
    assert result["layer_norm"]["sequence_parallel"] == [True, True]  # weight and bias: grads summed over TP
    assert result["config_sp_after"] is True  # the config is not left changed
    assert result["rms_error"] is None
    assert result["rms_norm"]["type"] == "RMSNorm" and result["rms_norm"]["sequence_parallel"] == [True]
    # Without SP the patch hands back exactly what upstream builds, parameters unmarked.
    assert result["patched_plain"] == result["upstream_plain"]
    assert result["patched_plain"]["sequence_parallel"] == [None, None]
    # Upstream's other assertions still hold under SP, and the config is restored when one fires.
    assert result["persist_error"] is not None and "persist_layer_norm" in result["persist_error"]
    assert result["persist_config_sp_after"] is True
    assert result["new_restored"] is True
    assert result["error_after_revert"] is not None and "sequence parallel" in result["error_after_revert"]
