"""The upstream patches: upstream fails each scenario, the patched upstream passes it.

Imports are process-global (a module imported once stays imported, a patched class stays patched),
so every scenario runs in a fresh interpreter (``tests.support.fresh.run``).
Only the version-gate tests run in this process: an out-of-range patch imports nothing.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_bridge_ext.patches import PATCHES, apply_all, base, bridge_prebuilt_dataset_helpers, revert_all, status_all
from megatron_bridge_ext.patches.base import APPLIED, NOT_APPLIED, NOT_NEEDED, OUT_OF_RANGE, REFUSED
from tests.support.fresh import run

TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None
without_te = pytest.mark.skipif(TE_INSTALLED, reason="Transformer Engine is installed: upstream imports and detects it")
without_nvrx = pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is not None,
                                  reason="nvidia-resiliency-ext is installed: Bridge's pretrain.py imports it")

_DATASETS = bridge_prebuilt_dataset_helpers.core_datasets_dir()
wheel_helpers = pytest.mark.skipif(
    _DATASETS is None or (_DATASETS / "Makefile").exists(),
    reason="Megatron Core's datasets directory has a Makefile (a source install): upstream builds the helpers")

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


# --------------------------------------------------------------------------------------------
# bridge_truthful_te_detection: LoRA() on Megatron Core's tensor-parallel linears
# --------------------------------------------------------------------------------------------

# One process, world size 1, TP=1; the CPU emulation goes in before Megatron Core's layers import.
LORA_SETUP = """
import tempfile

from megatron_bridge_ext.testing import cpu_emulation

cpu_emulation.install()
import torch
import torch.distributed as dist
from torch import nn

from megatron_bridge_ext.patches import bridge_peft_without_te, bridge_truthful_te_detection

assert bridge_peft_without_te.PATCH.apply()[0] == "applied"
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/rendezvous", rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

parallel_state.initialize_model_parallel()
from megatron.bridge.peft import utils as peft_utils
from megatron.bridge.peft.lora import LoRA
from megatron.bridge.peft.lora_layers import LoRALinear


def model():
    config = ModelParallelConfig(use_cpu_initialization=True)
    init = nn.init.xavier_normal_
    m = nn.Module()
    m.linear_qkv = ColumnParallelLinear(8, 12, config=config, init_method=init, bias=False, gather_output=False)
    m.linear_proj = RowParallelLinear(12, 8, config=config, init_method=init, bias=False, input_is_parallel=True,
                                      skip_bias_add=True)
    return m


def transform():
    '''(model with LoRA on both linears, None) or (None, the TypeError's text).'''
    try:
        out = LoRA(target_modules=["linear_qkv", "linear_proj"], dim=4, alpha=8)(model(), training=True)
    except TypeError as exc:
        return None, str(exc)
    return (out[0] if isinstance(out, list) else out), None
"""


@without_te
def test_upstream_lora_transform_fails_on_core_parallel_linears():
    result = run(LORA_SETUP, """
        out, error = transform()
        report(error=error, have_te=peft_utils.HAVE_TE)
    """)
    assert result["have_te"] is True  # Core's TE placeholder classes make Bridge believe TE is there
    assert result["error"] is not None, "upstream LoRA() was expected to raise TypeError"
    assert "isinstance" in result["error"]


@without_te
def test_patched_lora_transform_wraps_core_parallel_linears_and_revert_restores_upstream():
    result = run(LORA_SETUP, """
        status = bridge_truthful_te_detection.PATCH.apply()
        out, error = transform()
        y, _ = out.linear_qkv(torch.randn(3, 2, 8))
        patched = dict(
            status=status[0], error=error,
            types=[type(out.linear_qkv).__name__, type(out.linear_proj).__name__],
            lora_linear=[isinstance(out.linear_qkv, LoRALinear), isinstance(out.linear_proj, LoRALinear)],
            trainable=sorted(n for n, p in out.named_parameters() if p.requires_grad),
            out_shape=list(y.shape),
        )
        bridge_truthful_te_detection.PATCH.revert()
        _, error_after_revert = transform()
        report(**patched, have_te_after_revert=peft_utils.HAVE_TE, error_after_revert=error_after_revert)
    """)
    assert result["status"] == APPLIED
    assert result["error"] is None
    assert result["types"] == ["LoRALinear", "LoRALinear"]
    assert result["lora_linear"] == [True, True]
    assert result["trainable"] and all(".adapter." in name for name in result["trainable"])  # base weights frozen
    assert result["out_shape"] == [3, 2, 12]
    assert result["have_te_after_revert"] is True
    assert result["error_after_revert"] is not None and "isinstance" in result["error_after_revert"]


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


# --------------------------------------------------------------------------------------------
# bridge_plan_without_diffusion, core_training_plan_without_modelopt: what mbx plan's process leaves out
# (the same plan with and without them: tests/unit/test_cli_plan.py)
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


# --------------------------------------------------------------------------------------------
# bridge_pretrain_without_nvrx: Bridge's pretrain.py imports nvidia-resiliency-ext for a type hint
# --------------------------------------------------------------------------------------------

BRIDGE_WITHOUT_TE = '''
from megatron_bridge_ext.patches import bridge_peft_without_te


def import_bridge():
    """Import Megatron Bridge as our LoRA does (Transformer Engine is another patch's matter)."""
    bridge_peft_without_te.import_bridge_peft()


def upstream_loaded():
    return sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "megatron"))
'''


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


# --------------------------------------------------------------------------------------------
# bridge_recipe_hf_config: a Bridge model recipe reads its Hugging Face config from the hub
# --------------------------------------------------------------------------------------------

_HUB_RECIPE = """
    import json, socket

    from megatron_bridge_ext.patches import bridge_peft_without_te, bridge_recipe_hf_config
    from megatron_bridge_ext.estimate.configs import hf_config_object

    bridge_peft_without_te.import_bridge_peft()
    from transformers import AutoConfig

    calls = []
    def offline(cls, path, *args, **kwargs):  # the hub read, on a machine without the hub
        calls.append(kwargs.get("local_files_only", False))
        raise OSError("no connection")
    AutoConfig.from_pretrained = classmethod(offline)
    socket.create_connection = lambda *a, **k: (_ for _ in ()).throw(OSError("no network"))
    from megatron.bridge.recipes.qwen.qwen3 import qwen3_8b_peft_config

    def attempt():
        calls.clear()
        try:
            cfg = qwen3_8b_peft_config()
        except ValueError as error:
            return [len(calls), all(calls), str(error).splitlines()[0][:60]]
        return [len(calls), cfg.model.num_layers, cfg.model.hidden_size]

    data = json.load(open("tests/data/qwen3-8b/config.json"))
    data["num_hidden_layers"] = 5
"""


def test_upstream_recipe_retries_its_hub_read_four_times_and_the_patch_answers_or_fails_at_once():
    result = run(_HUB_RECIPE, """
        import time
        time.sleep = lambda seconds: None  # Bridge's backoff between attempts, not waited for here
        upstream = attempt()
        with bridge_recipe_hf_config.answering(hf_config_object(data)) as local_read:
            local = attempt()
        with bridge_recipe_hf_config.answering() as offline_read:
            failed = attempt()
        reverted = attempt()
        report(upstream=upstream, local=local, requested=local_read.requested, failed=failed,
               unreachable=offline_read.unreachable, reverted=reverted,
               applied=bridge_recipe_hf_config.PATCH.applied)
    """)
    assert result["upstream"][:2] == [4, False]  # 4 hub attempts, each of them with network retries inside
    assert result["local"] == [0, 5, 4096]  # the local file answered; the hub was never asked
    assert result["requested"] == "Qwen/Qwen3-8B"
    assert result["failed"][:2] == [1, True]  # one look in the local cache
    assert result["unreachable"].startswith("no connection to huggingface.co:443")
    assert result["reverted"][:2] == [4, False] and result["applied"] is False


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


# --------------------------------------------------------------------------------------------
# bridge_override_peft_check: a PEFT override Bridge cannot build stops the run
# --------------------------------------------------------------------------------------------

TYPO_OVERRIDES = ["+peft._target_=megatron_bridge_ext.peft.LoRA", "+peft.sequence_parallel_input_strategy=shard_lcoal"]
OVERRIDE_SCRIPT = f"""
import megatron_bridge_ext.peft  # allowlists our _target_
from megatron_bridge_ext.patches import bridge_peft_without_te
from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config
from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

cfg = process_config_with_overrides(vanilla_gpt_pretrain_config(), cli_overrides={TYPO_OVERRIDES!r})
report(peft=type(cfg.peft).__name__)
"""


def _run_script(*parts: str) -> subprocess.CompletedProcess:
    from tests.support.fresh import PRELUDE, ROOT

    script = "\n".join(textwrap.dedent(part) for part in (PRELUDE, *parts))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MBX_LOG_LEVEL="WARNING")
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_upstream_leaves_a_peft_override_it_cannot_build_as_a_dict_and_goes_on():
    done = _run_script("from megatron_bridge_ext.patches import bridge_peft_without_te\n"
                       "bridge_peft_without_te.import_bridge_peft()", OVERRIDE_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'RESULT {"peft": "DictConfig"}' in done.stdout or 'RESULT {"peft": "dict"}' in done.stdout


def test_after_init_a_misspelt_strategy_override_stops_the_run_with_one_line():
    done = _run_script("import megatron_bridge_ext\nfrom megatron_bridge_ext.levers import allocator\n"
                       "allocator.init = lambda **options: None\nmegatron_bridge_ext.init()", OVERRIDE_SCRIPT)
    assert done.returncode == 1 and "RESULT" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_bridge_ext: peft override not built: ")
    assert "'shard_lcoal'" in last and "did you mean 'shard_local'" in last
    assert not [line for line in done.stderr.splitlines() if line.startswith("Traceback")]  # ours: no traceback
