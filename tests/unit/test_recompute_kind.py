"""What ``core_attn`` recompute can save, decided from the config before anything is built."""

from types import SimpleNamespace

import pytest

from megatron_bridge_ext import recompute


def get_gpt_layer_with_transformer_engine_spec():  # named like Megatron Core's TE spec builder
    return None


def get_gpt_layer_local_spec():  # named like Megatron Core's local spec builder
    return None


@pytest.mark.parametrize(
    "spec, backend, kind",
    [
        (get_gpt_layer_with_transformer_engine_spec, "AttnBackend.auto", recompute.FUSED),
        (get_gpt_layer_with_transformer_engine_spec, "AttnBackend.flash", recompute.FUSED),
        (get_gpt_layer_with_transformer_engine_spec, "AttnBackend.unfused", recompute.UNFUSED),
        (get_gpt_layer_with_transformer_engine_spec, "AttnBackend.local", recompute.UNFUSED),
        (get_gpt_layer_local_spec, "AttnBackend.auto", recompute.UNFUSED),
    ],
)
def test_attention_kind_from_config(spec, backend, kind):
    found = recompute.attention_kind_from_config(SimpleNamespace(transformer_layer_spec=spec, attention_backend=backend))
    assert found.kind == kind
    effect = found.core_attn_effect()
    assert ("keeps no s x s matrix" in effect) == (kind == recompute.FUSED)


def test_fused_attention_makes_core_attn_a_no_effect_finding():
    from megatron_bridge_ext.config import MemoryConfig
    from megatron_bridge_ext.findings import NO_EFFECT

    model = SimpleNamespace(transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec,
                            attention_backend="AttnBackend.auto")
    findings = MemoryConfig(recompute_modules=["core_attn"])._recompute_findings(model)
    assert [f.level for f in findings] == [NO_EFFECT]
    assert "little or no memory" in findings[0].message


@pytest.mark.parametrize("dropout, expected_factor", [(0.0, 2), (0.1, 5)])
def test_core_attn_bytes_match_korthikanti_in_16_bit(dropout, expected_factor):
    # 5*a*s^2*b bytes per layer with dropout (softmax 2, mask 1, dropout output 2), divided by t.
    s, b, a, t = 1024, 2, 32, 4
    got = recompute.core_attn_bytes_per_layer(seq=s, micro_batch=b, heads=a, tp=t, element_size=2,
                                              attention_dropout=dropout)
    assert got == expected_factor * a * s * s * b // t
