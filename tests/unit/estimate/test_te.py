"""Transformer Engine's version as the estimate answers it where TE is not installed: the modelled release."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bridge_ext.estimate import te

pytestmark = [pytest.mark.unit]


def _absent_te():
    """A module's view of Core's version checks with no TE installed (Core's get_te_version answers 0.0.0)."""
    from packaging.version import Version

    return SimpleNamespace(is_te_min_version=lambda version, check_equality=True: False,
                           get_te_version=lambda: Version("0.0.0"))


def test_without_te_the_checks_answer_for_the_modelled_release_and_are_restored():
    module = _absent_te()
    before = (module.is_te_min_version, module.get_te_version)
    with te.version_checks_of_the_modelled_release(module):
        assert module.is_te_min_version("2.7.0")  # Bridge's delay_wgrad_compute check (comm_overlap.py L522)
        assert module.is_te_min_version(te.MODELLED_VERSION)
        assert not module.is_te_min_version(te.MODELLED_VERSION, check_equality=False)
        assert not module.is_te_min_version("2.18.0")
        assert str(module.get_te_version()) == te.MODELLED_VERSION
    assert (module.is_te_min_version, module.get_te_version) == before


def test_the_losss_te_version_check_answers_for_the_modelled_release_while_tracing():
    """Core's loss asserts TE >= 2.7.0 for the capturable cross entropy of full-iteration CUDA graphs
    (language_module.py L171-184); without TE installed its check says 0.0.0, which crashed the trace of Bridge's
    perf recipes that capture full iterations. While a stage is traced it answers for the modelled release."""
    from packaging.version import Version

    from megatron.core.models.common.language_module import language_module

    from megatron_bridge_ext.estimate import memory, te

    assert Version(te.MODELLED_VERSION) >= Version("2.7.0")
    assert not language_module.is_te_min_version("2.7.0")  # no Transformer Engine here
    with memory._te_checks_in_the_loss():
        assert language_module.is_te_min_version("2.7.0")
    assert not language_module.is_te_min_version("2.7.0")
