"""bridge_lora_te_norm_grad: Bridge's LoRA on a TE LayerNorm-linear under sequence parallelism keeps its input gradient."""

from __future__ import annotations

import pytest
from packaging.version import Version

from megatron_bridge_ext.patches import base
from megatron_bridge_ext.patches.base import APPLIED, NOT_APPLIED, NOT_NEEDED, REFUSED
from tests.support.fresh import run
from tests.support.patches import without_te

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# bridge_lora_te_norm_grad: TE >= 2.4 drops the gradient of a gathered returned norm output
# (the numerics, upstream failing and patched passing, are in tests/functional/test_te_path.py)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("installed, affected, needed", [
    (None, False, False), ("1.4.0", False, False), ("1.13.0", False, True), ("2.3.0", False, True),
    ("2.3.99", False, True), ("2.4.0.dev0", True, True), ("2.4.0", True, True), ("2.18.0", True, True)])
def test_te_versions_affected_by_the_dropped_norm_gradient(monkeypatch, installed, affected, needed):
    """Every layer from TE 2.4 on; from TE 1.5 (the gathered return) to 2.3 only layers with Userbuffers
    rs_dgrad/bulk_wgrad overlap, which the patch decides per layer: it is needed there too."""
    from megatron_bridge_ext import versions
    from megatron_bridge_ext.patches import bridge_lora_te_norm_grad

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version",
                        lambda name: (Version(installed) if installed else None) if name == "transformer-engine"
                        else real(name))
    got, why = bridge_lora_te_norm_grad.te_affected()
    assert got is affected
    assert ("not installed" in why) if installed is None else (installed in why)
    assert bridge_lora_te_norm_grad.PATCH.status()[0] == (NOT_APPLIED if needed else NOT_NEEDED)


def test_te_norm_grad_patch_wraps_the_adapter_wrapper_and_revert_restores_it():
    result = run("""
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        from megatron_bridge_ext import versions
        from megatron_bridge_ext.patches import bridge_lora_te_norm_grad, bridge_peft_without_te

        versions.installed_version = lambda name: Version("2.8.0")
        bridge_peft_without_te.import_bridge_peft()
        from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

        original = AdapterWrapper.__dict__["base_linear_forward"]
        status = bridge_lora_te_norm_grad.PATCH.apply()[0]
        wrapped = AdapterWrapper.__dict__["base_linear_forward"]
        again = bridge_lora_te_norm_grad.PATCH.apply()[0]
        same = AdapterWrapper.__dict__["base_linear_forward"] is wrapped
        bridge_lora_te_norm_grad.PATCH.revert()
        report(status=status, again=again, replaced=wrapped is not original, wraps=wrapped.__wrapped__ is original,
               same=same, restored=AdapterWrapper.__dict__["base_linear_forward"] is original)
    """)
    assert result == {"status": APPLIED, "again": APPLIED, "replaced": True, "wraps": True, "same": True,
                      "restored": True}


def _sets_the_gathered_flag(m):
    """Stands for Bridge's get_adapter_attributes_from_linear: it sets the flag the patch relies on."""
    m.return_layernorm_output_gathered = True


def _sets_nothing(m):
    """Stands for a Bridge that feeds LoRA-A the norm output some other way."""
    return m


@pytest.fixture
def fake_bridge_peft(monkeypatch):
    """Put stand-ins for Bridge's adapter_wrapper and peft utils in sys.modules (TE 2.8 installed); returns a function
    that shapes them. Nothing of Bridge is imported; the patch is reverted afterwards."""
    import sys
    import types

    from megatron_bridge_ext import versions
    from megatron_bridge_ext.patches import bridge_lora_te_norm_grad as te_patch

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version",
                        lambda name: Version("2.8.0") if name == "transformer-engine" else real(name))
    te_patch.PATCH.revert()

    def shape(*, method: bool, setter):
        wrapper_module, utils = types.ModuleType(te_patch.TARGET_MODULE), types.ModuleType(te_patch.UTILS_MODULE)
        wrapper_module.AdapterWrapper = type("AdapterWrapper", (), {"base_linear_forward": lambda self, x: x}
                                             if method else {"forward": lambda self, x: x})
        utils.get_adapter_attributes_from_linear = setter
        monkeypatch.setitem(sys.modules, te_patch.TARGET_MODULE, wrapper_module)
        monkeypatch.setitem(sys.modules, te_patch.UTILS_MODULE, utils)
        return wrapper_module.AdapterWrapper

    yield shape
    te_patch.PATCH.revert()


def test_te_norm_grad_gate_applies_where_the_structure_is_there(fake_bridge_peft):
    from megatron_bridge_ext.patches import bridge_lora_te_norm_grad as te_patch

    wrapper = fake_bridge_peft(method=True, setter=_sets_the_gathered_flag)
    original = wrapper.__dict__["base_linear_forward"]
    status, why = te_patch.PATCH.apply()
    wrapped = wrapper.__dict__["base_linear_forward"]
    assert (status, te_patch.PATCH.status()[0]) == (APPLIED, APPLIED), why
    assert wrapped is not original and wrapped.__wrapped__ is original
    te_patch.PATCH.revert()
    assert wrapper.__dict__["base_linear_forward"] is original


@pytest.mark.parametrize("method, setter, missing", [
    (False, _sets_the_gathered_flag, "AdapterWrapper defines no base_linear_forward"),
    (True, _sets_nothing, "no longer sets return_layernorm_output_gathered")], ids=["no-method", "no-gathered-flag"])
def test_te_norm_grad_gate_refuses_loudly_where_the_structure_is_missing(fake_bridge_peft, caplog, method, setter,
                                                                         missing):
    from megatron_bridge_ext.patches import bridge_lora_te_norm_grad as te_patch

    wrapper = fake_bridge_peft(method=method, setter=setter)
    before = dict(wrapper.__dict__)
    with caplog.at_level("INFO", logger="megatron_bridge_ext.patches"):
        status, why = te_patch.PATCH.apply()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert status == REFUSED and te_patch.PATCH.status() == (status, why)
    assert missing in why and "Fix: use megatron_bridge_ext.peft.LoRA" in why
    assert len(warnings) == 1 and missing in warnings[0]
    assert dict(wrapper.__dict__) == before  # nothing changed


def test_te_norm_grad_gate_has_no_upper_bridge_version(monkeypatch):
    """A Bridge release after 0.6.2 with the same structure gets the patch (it used to be 'out of range')."""
    from megatron_bridge_ext.patches import bridge_lora_te_norm_grad as te_patch

    monkeypatch.setattr(base, "installed_version", lambda name: Version("0.9.0"))
    assert te_patch.PATCH.in_range()[0] is True
    monkeypatch.setattr(base, "installed_version", lambda name: Version("0.5.0"))
    assert te_patch.PATCH.in_range()[0] is False  # the lower bound stays


@without_te
def test_init_wraps_bridges_adapter_wrapper_when_bridge_is_imported_after_it():
    result = run("""
        from packaging.version import Version

        import megatron_bridge_ext
        from megatron_bridge_ext import versions
        from megatron_bridge_ext.levers import allocator
        from megatron_bridge_ext.patches import bridge_lora_te_norm_grad as te_patch, bridge_peft_without_te

        real = versions.installed_version
        versions.installed_version = lambda name: Version("2.4.0") if name == "transformer-engine" else real(name)
        allocator.init = lambda **options: None
        megatron_bridge_ext.init()
        loaded_by_init = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "megatron"))
        bridge_peft_without_te.import_bridge_peft()
        from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
        from megatron.bridge.peft.lora import LoRA

        method = AdapterWrapper.__dict__["base_linear_forward"]
        report(loaded_by_init=loaded_by_init, wrapped=hasattr(method, "__wrapped__"),
               status=te_patch.PATCH.status()[0], check=te_patch.check_installed())
    """)
    assert result == {"loaded_by_init": [], "wrapped": True, "status": APPLIED, "check": True}
