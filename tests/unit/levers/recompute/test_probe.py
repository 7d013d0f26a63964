"""RecomputeProbe wraps Megatron Core's checkpointed attention once, counts for every active probe,
and puts back exactly what it found, whatever order nested probes exit in."""

import pytest

from megatron_bridge_ext.levers.recompute.probe import RecomputeProbe

pytestmark = pytest.mark.unit

NAME = "_checkpointed_attention_forward"


@pytest.fixture
def attention(monkeypatch):
    from megatron.core.transformer.attention import Attention

    calls = []

    def stand_in(module, *args, **kwargs):
        calls.append(module)
        return "out"

    monkeypatch.setattr(Attention, NAME, stand_in)
    return Attention, stand_in, calls


@pytest.mark.parametrize("exit_order", ["inner first", "outer first"])
def test_nested_probes_count_each_call_and_restore_the_original(attention, exit_order):
    cls, original, calls = attention
    outer, inner = RecomputeProbe(), RecomputeProbe()
    outer.__enter__()
    assert getattr(cls, NAME)("a") == "out"
    inner.__enter__()
    getattr(cls, NAME)("b")
    first, second = (inner, outer) if exit_order == "inner first" else (outer, inner)
    first.__exit__(None, None, None)
    assert cls.__dict__[NAME] is not original  # the other probe is still counting
    getattr(cls, NAME)("c")
    second.__exit__(None, None, None)
    assert cls.__dict__[NAME] is original
    assert calls == ["a", "b", "c"]
    assert (outer.checkpointed_forwards, inner.checkpointed_forwards) == ((3, 1) if exit_order == "inner first"
                                                                          else (2, 2))


def test_an_inherited_method_is_left_inherited(attention, monkeypatch):
    cls, original, _ = attention

    class Base:
        pass

    setattr(Base, NAME, original)
    Sub = type("Sub", (Base,), {})
    monkeypatch.setattr(RecomputeProbe, "_attention_class", staticmethod(lambda: Sub))
    with RecomputeProbe() as probe:
        assert NAME in Sub.__dict__
        getattr(Sub, NAME)("x")
    assert NAME not in Sub.__dict__ and getattr(Sub, NAME) is original
    assert probe.checkpointed_forwards == 1
