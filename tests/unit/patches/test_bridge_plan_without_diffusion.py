"""The plan-only import patches (bridge_plan_without_diffusion and core_training_plan_without_modelopt): what mbx plan's process leaves out."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.patches.base import APPLIED, NOT_APPLIED, NOT_NEEDED
from tests.support.fresh import run
from tests.support.patches import without_te

pytestmark = [pytest.mark.unit]


# --------------------------------------------------------------------------------------------
# bridge_plan_without_diffusion, core_training_plan_without_modelopt: what mbx plan's process leaves out
# (the same plan with and without them: tests/unit/cli/test_plan.py)
# --------------------------------------------------------------------------------------------

_IMPORT_BRIDGE_AND_REPORT = """
    from megatron_bridge_ext.estimate.configs import hf_config_object
    from megatron_bridge_ext.patches import bridge_peft_without_te, registry

    with registry.plan_imports() if LEAN else contextlib.nullcontext():
        statuses = [p.status() for p in registry.PLAN_IMPORTS]
        bridge_peft_without_te.import_bridge_peft()
        from megatron.bridge import AutoBridge
        from megatron.bridge.recipes.gpt import vanilla_gpt  # the recipes package: every family's recipes
        from megatron.training import checkpointing, training

        hf = hf_config_object(json.load(open("tests/data/qwen3-8b/config.json")))
        built = AutoBridge.from_hf_config(hf).to_megatron_provider(load_weights=False)  # by the Qwen3 bridge
        state = dict(statuses=statuses, refusals=[p.refusal() for p in registry.PLAN_IMPORTS],
                     imported=[n for n in ("megatron.bridge.diffusion.models", "modelopt") if n in sys.modules],
                     modelopt_flags=[checkpointing.has_nvidia_modelopt, training.has_nvidia_modelopt],
                     provider=[getattr(built, k) for k in ("num_layers", "qk_layernorm", "num_query_groups")])
    import megatron.bridge.diffusion.models  # after the plan, both import as usual
    import modelopt.torch.opt.plugins

    report(**state, recipe=callable(vanilla_gpt.vanilla_gpt_pretrain_config),
           applied_after=[p.applied for p in registry.PLAN_IMPORTS], hooks_after=import_hooks.hooks_installed())
"""


@without_te
@pytest.mark.parametrize("lean", [False, True], ids=["upstream", "patched"])
def test_the_plan_imports_bridge_without_diffusion_bridges_and_modelopt(lean):
    """Upstream, any Bridge import registers every diffusion bridge, any recipe import brings the diffusion recipes,
    and Megatron's training package imports ModelOpt; under the plan's patches neither is imported, the training package takes its own fallback, AutoBridge still
    builds Qwen3's provider, and once the plan is done the hooks are gone and both import as usual."""
    result = run(f"import contextlib\nfrom megatron_bridge_ext.patches import import_hooks\nLEAN = {lean!r}",
                 _IMPORT_BRIDGE_AND_REPORT)
    assert result["provider"] == [36, True, 8]  # config.json's layers and KV heads; QK norm is the Qwen3 bridge's
    assert result["applied_after"] == [False, False] and result["hooks_after"] == 0 and result["recipe"] is True
    if lean:
        assert [s[0] for s in result["statuses"]] == [APPLIED, APPLIED]
        assert result["imported"] == [] and result["modelopt_flags"] == [False, False]
        assert result["refusals"] == [None, None]
    else:
        assert [s[0] for s in result["statuses"]] == [NOT_APPLIED, NOT_APPLIED]
        assert result["imported"] == ["megatron.bridge.diffusion.models", "modelopt"]
        # without megatron.post_training (the Core wheel lacks it) checkpointing's fallback is taken upstream too
        assert result["modelopt_flags"][0] is False


def test_the_plan_import_patches_are_not_needed_once_bridge_is_imported():
    """Applied after the process imported Bridge, they would skip nothing: not needed, nothing installed."""
    result = run("""
        from megatron_bridge_ext.patches import bridge_peft_without_te, import_hooks, registry

        bridge_peft_without_te.import_bridge_peft()
        with registry.plan_imports():
            hooks = import_hooks.hooks_installed()
        report(statuses=[p.status()[0] for p in registry.PLAN_IMPORTS], hooks=hooks)
    """)
    assert result == {"statuses": [NOT_NEEDED, NOT_NEEDED], "hooks": 0}


def test_a_plan_import_patch_that_refused_says_so_at_warning():
    """A hook's refusal is known once the plan has imported its target: it is logged at WARNING, as for every patch."""
    result = run("""
        import logging

        from megatron_bridge_ext.patches import registry

        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append([record.levelname, record.getMessage()])

        logging.getLogger("megatron_bridge_ext.patches").addHandler(Keep())
        patch = registry.PLAN_IMPORTS[-1]
        with registry.plan_imports():
            patch.refusal = lambda: "its target changed shape"  # as found once the plan imported the target
        report(name=patch.name, warnings=[r for r in records if r[0] == "WARNING"], applied=patch.applied)
    """)
    assert result["warnings"] == [["WARNING", f"patch {result['name']} refused: its target changed shape"]]
    assert result["applied"] is False
