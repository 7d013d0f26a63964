"""bridge_prebuilt_dataset_helpers: Bridge's initialisation uses Core's prebuilt dataset helpers; init() applies the training-entry patches first."""

from __future__ import annotations

import importlib.machinery

import pytest

from megatron_bridge_ext.patches import bridge_prebuilt_dataset_helpers
from megatron_bridge_ext.patches.base import APPLIED
from tests.support.fresh import run
from tests.support.patches import BRIDGE_WITHOUT_TE, wheel_helpers, without_nvrx, without_te

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# bridge_prebuilt_dataset_helpers: Bridge's initialize_megatron runs make where the wheel has no Makefile
# --------------------------------------------------------------------------------------------

# initialize_megatron calls initialize.compile_helpers() on local rank 0 (Bridge initialize.py L147).
COMPILE_HELPERS = BRIDGE_WITHOUT_TE + '''
import subprocess

make_runs = []
_subprocess_run = subprocess.run


def recording_run(command, *args, **kwargs):
    make_runs.append(list(command)[0])
    return _subprocess_run(command, *args, **kwargs)


subprocess.run = recording_run


def compile_helpers():
    """[exit status or None, whether make ran] for Bridge's compile_helpers() call."""
    from megatron.bridge.training import initialize

    make_runs.clear()
    try:
        initialize.compile_helpers()
        status = None
    except SystemExit as exc:
        status = exc.code
    return [status, make_runs == ["make"]]
'''


@without_te
@wheel_helpers
def test_upstream_compile_helpers_exits_with_status_1_on_the_installed_wheel():
    result = run(COMPILE_HELPERS, """
        import_bridge()
        report(compile=compile_helpers())
    """)
    assert result["compile"] == [1, True]


@without_te
@wheel_helpers
def test_patched_compile_helpers_uses_the_prebuilt_extension_and_otherwise_keeps_upstream():
    result = run(COMPILE_HELPERS, """
        from megatron_bridge_ext.patches import bridge_prebuilt_dataset_helpers as helpers_patch

        status = helpers_patch.PATCH.apply()  # before Bridge is imported: an import hook
        loaded_by_apply = upstream_loaded()
        import_bridge()
        prebuilt = compile_helpers()
        sys.modules[helpers_patch.PREBUILT] = None  # the prebuilt extension no longer imports
        missing = compile_helpers()
        del sys.modules[helpers_patch.PREBUILT]
        helpers_patch.PATCH.revert()
        after_revert = compile_helpers()
        helpers_patch.PATCH.apply()  # after Bridge's import: rebinds at once
        applied_late = compile_helpers()
        report(status=status[0], loaded_by_apply=loaded_by_apply, prebuilt=prebuilt, missing=missing,
               after_revert=after_revert, applied_late=applied_late)
    """)
    assert result["status"] == APPLIED
    assert result["loaded_by_apply"] == []
    assert result["prebuilt"] == [None, False]  # no make, no exit
    assert result["missing"] == [1, True]  # without the prebuilt extension: upstream's build, and its exit
    assert result["after_revert"] == [1, True]
    assert result["applied_late"] == [None, False]


def test_the_helpers_patch_is_needed_only_with_a_prebuilt_extension_and_no_makefile(tmp_path, monkeypatch):
    datasets = tmp_path / "megatron" / "core" / "datasets"
    datasets.mkdir(parents=True)
    monkeypatch.setattr(bridge_prebuilt_dataset_helpers, "core_datasets_dir", lambda: datasets)

    verdicts = [bridge_prebuilt_dataset_helpers.PATCH.needed()[0]]  # neither file: nothing to use
    (datasets / ("helpers_cpp" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    verdicts.append(bridge_prebuilt_dataset_helpers.PATCH.needed()[0])  # the wheel's layout
    (datasets / "Makefile").write_text("all:\n")
    verdicts.append(bridge_prebuilt_dataset_helpers.PATCH.needed()[0])  # a source checkout: make works

    assert verdicts == [False, True, False]


# --------------------------------------------------------------------------------------------
# megatron_bridge_ext.init(), the first line of a training script, applies both and imports nothing upstream
# --------------------------------------------------------------------------------------------

@without_te
@without_nvrx
@wheel_helpers
def test_init_applies_the_training_entry_patches_before_the_script_imports_bridge():
    result = run(COMPILE_HELPERS, """
        import megatron_bridge_ext
        from megatron_bridge_ext.patches import registry

        megatron_bridge_ext.init()
        loaded_by_init = upstream_loaded()
        applied = [p.name for p in registry.TRAINING_ENTRY if p.applied]
        import_bridge()
        from megatron.bridge.training.finetune import finetune  # the script's own top-level import

        report(loaded_by_init=loaded_by_init, applied=applied, compile=compile_helpers())
    """)
    assert result["loaded_by_init"] == []
    assert result["applied"] == ["bridge_pretrain_without_nvrx", "bridge_prebuilt_dataset_helpers"]
    assert result["compile"] == [None, False]
