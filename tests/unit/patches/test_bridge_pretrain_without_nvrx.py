"""bridge_pretrain_without_nvrx: Bridge's training entry points import without nvidia-resiliency-ext."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.patches.base import APPLIED
from tests.support.fresh import run
from tests.support.patches import BRIDGE_WITHOUT_TE, without_nvrx, without_te

pytestmark = [pytest.mark.unit]


@without_te
@without_nvrx
def test_upstream_entry_points_fail_to_import_without_nvrx_as_after_a_reverted_patch():
    result = run(BRIDGE_WITHOUT_TE, """
        from megatron_bridge_ext.patches import bridge_pretrain_without_nvrx, import_hooks

        bridge_pretrain_without_nvrx.PATCH.apply()
        bridge_pretrain_without_nvrx.PATCH.revert()  # before Bridge is imported: upstream as it is
        import_bridge()
        try:
            from megatron.bridge.training.finetune import finetune
        except ImportError as exc:
            report(error=type(exc).__name__, name=exc.name, hooks=import_hooks.hooks_installed())
        else:
            report(error=None)
    """)
    assert result == {"error": "ModuleNotFoundError", "name": "nvidia_resiliency_ext", "hooks": 0}


@without_te
@without_nvrx
def test_patched_entry_points_import_when_applied_first_and_the_stub_stays_scoped():
    result = run(BRIDGE_WITHOUT_TE, """
        import importlib.util

        from megatron_bridge_ext.patches import bridge_pretrain_without_nvrx

        status = bridge_pretrain_without_nvrx.PATCH.apply()
        loaded_by_apply = upstream_loaded()
        import_bridge()
        from megatron.bridge.training import pretrain as pretrain_module
        from megatron.bridge.training.finetune import finetune
        from megatron.bridge.utils.import_utils import safe_import

        try:
            pretrain_module.CallWrapper()
            use_error = None
        except ImportError as exc:
            use_error = str(exc)
        report(
            status=status[0], loaded_by_apply=loaded_by_apply, finetune=finetune.__module__,
            nvrx_modules=[n for n in sys.modules if n.startswith("nvidia_resiliency_ext")],
            nvrx_spec=importlib.util.find_spec("nvidia_resiliency_ext") is not None,
            bridge_sees_nvrx=safe_import("nvidia_resiliency_ext.inprocess")[1], use_error=use_error,
        )
    """)
    assert result["status"] == APPLIED
    assert result["loaded_by_apply"] == []  # an import hook: applying it imports nothing upstream
    assert result["finetune"] == "megatron.bridge.training.finetune"
    assert result["nvrx_modules"] == []  # the placeholder never reaches sys.modules
    assert result["nvrx_spec"] is False
    assert result["bridge_sees_nvrx"] is False  # Bridge's guarded uses still see the package as absent
    assert result["use_error"] is not None and "pip install nvidia-resiliency-ext" in result["use_error"]
    assert "CallWrapper" in result["use_error"]
