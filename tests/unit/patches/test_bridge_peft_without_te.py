"""bridge_peft_without_te: Bridge's PEFT modules import without Transformer Engine (upstream fails, the patch passes)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.patches.base import APPLIED, NOT_APPLIED
from tests.support.fresh import run
from tests.support.patches import without_te

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# bridge_peft_without_te: Bridge's PEFT modules import Transformer Engine at module level
# --------------------------------------------------------------------------------------------

@without_te
def test_upstream_bridge_lora_import_fails_without_te():
    result = run("""
        try:
            import megatron.bridge.peft.lora
        except ImportError as exc:
            report(error=type(exc).__name__, name=exc.name, message=str(exc))
        else:
            report(error=None)
    """)
    assert result["error"] in ("ModuleNotFoundError", "ImportError")
    assert "transformer_engine" in f"{result['name']} {result['message']}"


@without_te
def test_patched_bridge_lora_imports_and_the_placeholder_stays_scoped():
    result = run("""
        import importlib.metadata
        import importlib.util
        from megatron_bridge_ext.patches import bridge_peft_without_te

        status = bridge_peft_without_te.PATCH.apply()
        import megatron.bridge.peft.lora
        from megatron.bridge.peft import lora_layers
        from megatron.bridge.utils.import_utils import safe_import

        try:
            lora_layers.te.Linear(4, 4)
            use_error = None
        except ImportError as exc:
            use_error = str(exc)
        report(
            status=status[0],
            te_modules=[name for name in sys.modules if name.split(".")[0] == "transformer_engine"],
            te_spec=importlib.util.find_spec("transformer_engine") is not None,
            bridge_sees_te=safe_import("transformer_engine")[1],
            use_error=use_error,
        )
    """)
    assert result["status"] == APPLIED
    assert result["te_modules"] == []  # the placeholder never reaches sys.modules
    assert result["te_spec"] is False
    assert result["bridge_sees_te"] is False  # Bridge's own checks elsewhere still see TE as absent
    assert result["use_error"] is not None, "instantiating a placeholder TE class must raise ImportError"
    assert "Transformer Engine is not installed" in result["use_error"]
    assert "transformer_engine.Linear" in result["use_error"]


@without_te
def test_status_stays_needed_after_this_process_imported_bridge_peft_through_the_hook():
    """`mbx patches` imports Bridge's PEFT modules through the hook to inspect them; a script that imports
    Bridge first still fails, so the report must keep saying the patch is needed, and how to get it."""
    result = run("""
        from megatron_bridge_ext.patches import bridge_peft_without_te
        from megatron_bridge_ext.cli.patches import STATUS_WORDS

        bridge_peft_without_te.import_bridge_peft()
        status, why = bridge_peft_without_te.PATCH.status()
        report(status=status, words=STATUS_WORDS[status], why=why)
    """)
    assert result["status"] == NOT_APPLIED, result
    assert result["words"].startswith("needed here")
    assert "megatron_bridge_ext.init()" in result["why"]


BROKEN_TE = """
import os, sys

os.environ["MBX_TEST_TE_TRIED"] = str(int(os.environ.get("MBX_TEST_TE_TRIED", "0")) + 1)
import transformer_engine_torch  # the framework extension, missing here as in a TE install without its torch part
"""


@without_te
def test_te_that_is_installed_but_does_not_import_is_tried_only_when_bridge_imports_it(tmp_path):
    """A TE package that is there but fails to import (its torch extension missing): init() and the patch's
    needed() import nothing; Bridge's PEFT modules, imported after init(), get the placeholder once their
    import of TE is tried and fails."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text(BROKEN_TE)
    result = run(f"""
        import os
        sys.path.insert(0, {str(tmp_path)!r})
        import megatron_bridge_ext
        from megatron_bridge_ext.levers import allocator
        from megatron_bridge_ext.patches import bridge_peft_without_te

        needed = bridge_peft_without_te.PATCH.needed()[0]
        allocator.init = lambda **options: None
        megatron_bridge_ext.init()
        tried_by_init = os.environ.get("MBX_TEST_TE_TRIED", "0")
        loaded_by_init = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "megatron", "transformer_engine"))
        from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config
        from megatron.bridge.peft import lora_layers

        report(needed=needed, tried_by_init=tried_by_init, loaded_by_init=loaded_by_init,
               tried_by_bridge=int(os.environ.get("MBX_TEST_TE_TRIED", "0")) > 0,
               placeholder=(lora_layers.te.__doc__ or "").startswith("megatron-bridge-ext placeholder"),
               recipe=callable(vanilla_gpt_pretrain_config))
    """)
    assert result["needed"] is True and result["tried_by_init"] == "0" and result["loaded_by_init"] == []
    assert result["tried_by_bridge"] and result["placeholder"] and result["recipe"] is True


@without_te
def test_after_init_a_script_imports_bridge_and_its_recipes_without_te():
    """Without the hook `import megatron.bridge` reaches Bridge's PEFT modules, which import TE (see the first test)."""
    result = run("""
        import megatron_bridge_ext
        from megatron_bridge_ext.levers import allocator
        from megatron_bridge_ext.patches import bridge_peft_without_te

        allocator.init = lambda **options: None
        megatron_bridge_ext.init()
        loaded_by_init = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "megatron", "transformer_engine"))
        from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config  # before megatron_bridge_ext.peft

        report(loaded_by_init=loaded_by_init, status=bridge_peft_without_te.PATCH.status()[0],
               recipe=callable(vanilla_gpt_pretrain_config))
    """)
    assert result == {"loaded_by_init": [], "status": APPLIED, "recipe": True}
