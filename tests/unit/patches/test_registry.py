"""The patch registry: idempotence, version gates, status."""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_bridge_ext.patches import PATCHES, apply_all, base, revert_all, status_all
from megatron_bridge_ext.patches.base import APPLIED, NOT_APPLIED, NOT_NEEDED, OUT_OF_RANGE
from tests.support.fresh import run
from tests.support.patches import wheel_helpers, without_nvrx, without_te

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# The registry: idempotence, version gates, status
# --------------------------------------------------------------------------------------------

@without_te
@without_nvrx
@wheel_helpers
def test_apply_all_is_idempotent_and_revert_all_undoes_it_once():
    result = run("""
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        from megatron_bridge_ext import patches
        from megatron_bridge_ext.patches import import_hooks

        original_new = WrappedTorchNorm.__dict__["__new__"]
        first = patches.apply_all()
        wrapped_new = WrappedTorchNorm.__dict__["__new__"]
        second = patches.apply_all()
        from megatron.bridge.peft import utils as peft_utils

        state_applied = dict(hooks=import_hooks.hooks_installed(),
                             same_wrapper=WrappedTorchNorm.__dict__["__new__"] is wrapped_new,
                             have_te=peft_utils.HAVE_TE)
        patches.revert_all()
        report(
            first=[s.status for s in first], second=[[s.status, s.reason] for s in second], **state_applied,
            hooks_after_revert=import_hooks.hooks_installed(),
            new_restored=WrappedTorchNorm.__dict__["__new__"] is original_new,
            have_te_after_revert=peft_utils.HAVE_TE, applied_after_revert=[p.applied for p in patches.PATCHES],
        )
    """)
    # the TE gradient patch is not needed without Transformer Engine (see test_bridge_lora_te_norm_grad)
    # the plan's import patches come after patches that import Bridge: nothing is left to keep out then
    expected = [APPLIED] * 3 + [NOT_NEEDED] + [APPLIED] * 4 + [NOT_NEEDED] * 2
    assert result["first"] == expected
    assert [s[0] for s in result["second"]] == expected
    assert [s[1] for s in result["second"] if s[0] == APPLIED] == ["already applied"] * 7
    assert [s[1] for s in result["second"][-2:]] == ["megatron.bridge is already imported in this process",
                                                      "megatron.training.checkpointing is already imported in this "
                                                      "process"]
    # Bridge's PEFT modules, Bridge's pretrain, Bridge's initialize, Bridge's override utilities: one each
    assert result["hooks"] == 4
    assert result["same_wrapper"] is True  # not wrapped twice
    assert result["have_te"] is False
    assert result["hooks_after_revert"] == 0
    assert result["new_restored"] is True
    assert result["have_te_after_revert"] is True
    assert result["applied_after_revert"] == [False] * 10


@pytest.fixture
def patches_unapplied():
    """Start from no applied patch (another test module in this process may have applied them), and
    put back whatever was applied afterwards."""
    was_applied = any(p.applied for p in PATCHES)
    revert_all()
    yield
    if was_applied:
        apply_all()


@pytest.mark.parametrize("installed", ["0.4.0", "1.0.0", None], ids=["below", "above", "not-installed"])
def test_out_of_range_version_is_reported_and_applies_nothing(patches_unapplied, monkeypatch, installed):
    calls = []
    monkeypatch.setattr(base, "installed_version", lambda dist: None if installed is None else Version(installed))
    for patch in PATCHES:
        monkeypatch.setattr(patch, "needed", lambda name=patch.name: calls.append(("needed", name)) or (True, ""))
        monkeypatch.setattr(patch, "do_apply", lambda name=patch.name: calls.append(("apply", name)) or (lambda: None))

    out = [p for p in PATCHES if installed is None or Version(installed) not in SpecifierSet(p.versions)]
    monkeypatch.setattr("megatron_bridge_ext.patches.registry.PATCHES", tuple(out))
    applied = apply_all()
    reported = status_all()

    assert installed == "1.0.0" or len(out) == len(PATCHES)  # above: the TE patch has no upper bound (its own test)
    assert calls == []  # neither inspected nor applied
    assert [p.applied for p in out] == [False] * len(out)
    for patch, result in zip(out, applied):
        assert result.status == OUT_OF_RANGE
        assert patch.distribution in result.reason
        if installed is None:
            assert "not installed" in result.reason
        else:
            assert installed in result.reason and patch.versions in result.reason
    assert [(s.status, s.reason) for s in reported] == [(s.status, s.reason) for s in applied]


@without_te
@without_nvrx
@wheel_helpers
def test_status_all_lists_every_patch_and_changes_nothing():
    result = run(r"""
        from dataclasses import asdict

        from megatron_bridge_ext import patches

        before = patches.status_all()
        bridge_imported_by_status = any(name.startswith("megatron.bridge") for name in sys.modules)
        patches.apply_all()
        after = patches.status_all()
        import megatron.bridge.peft.lora  # Bridge still imports cleanly after a status report

        import importlib
        import re

        def resolves(target):  # the first dotted name of a target string, as a module attribute (or module)
            dotted = re.match(r"[\w.]+", target).group(0)
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for name in parts[cut:]:
                    obj = getattr(obj, name)
                return True
            return False

        report(before=[asdict(s) for s in before], after=[asdict(s) for s in after],
               bridge_imported_by_status=bridge_imported_by_status,
               resolves=[resolves(s.target) for s in before])
    """)
    before, after = result["before"], result["after"]
    assert [s["name"] for s in before] == [p.name for p in PATCHES] == [
        "bridge_peft_without_te", "bridge_truthful_te_detection", "core_local_norm_sequence_parallel",
        "bridge_lora_te_norm_grad", "bridge_pretrain_without_nvrx", "bridge_prebuilt_dataset_helpers",
        "bridge_recipe_hf_config", "bridge_override_peft_check", "bridge_plan_without_diffusion",
        "core_training_plan_without_modelopt"]
    assert result["resolves"] == [True] * len(before)  # every target names something that exists upstream
    for row in before:
        distribution, _, specifier = row["versions"].partition(" ")
        installed = importlib.metadata.version(distribution)
        assert Version(installed) in SpecifierSet(specifier), (row["name"], installed, specifier)
        assert row["status"] in (APPLIED, NOT_NEEDED, OUT_OF_RANGE, NOT_APPLIED)
        assert row["reason"] and row["applied_by"]
    assert "lora_layers" in before[0]["target"]
    assert "HAVE_TE" in before[1]["target"]
    assert "WrappedTorchNorm" in before[2]["target"]
    assert "CallWrapper" in before[4]["target"]
    assert "compile_helpers" in before[5]["target"]
    assert "AutoConfig.from_pretrained" in before[6]["target"]
    assert before[7]["target"].endswith("omegaconf_utils.process_config_with_overrides")
    assert "diffusion" in before[8]["target"] and "modelopt" in before[9]["target"]
    assert [before[i]["status"] for i in (0, 2, 4)] == [NOT_APPLIED] * 3
    assert APPLIED not in [s["status"] for s in before]
    assert result["bridge_imported_by_status"] is False  # a half-failed Bridge import would poison the process
    assert [s["status"] for s in after] == [APPLIED] * 3 + [NOT_NEEDED] + [APPLIED] * 4 + [NOT_NEEDED] * 2
    assert all(s["reason"] for s in after)
