"""Bridge's LoRA on a Transformer Engine LayerNorm-linear under sequence parallelism gets its input gradient.

Megatron Bridge (0.5.1 ``peft/utils.py`` L576, 0.6.2 L611, ``get_adapter_attributes_from_linear``)
sets ``return_layernorm_output_gathered=True`` on TE's ``LayerNormColumnParallelLinear`` under
sequence parallelism and feeds that gathered LayerNorm output to LoRA-A (``LoRALinear``,
``DoRALinear`` and CanonicalLoRA's split wrappers all take it from
``AdapterWrapper.base_linear_forward``). Up to TE 2.3 TE's backward added the gradient of that
returned gathered tensor to its input gradient before the reduce-scatter; TE commit ce0b46c4d
(first in TE 2.4, still so at TE main) removed the addition: TE now uses that gradient only when
the norm output is returned *not* gathered (``layernorm_linear.py``, v2.4 L895-898). So with
TE >= 2.4 the gradient the LoRA branch sends back to its input is dropped in every layer whose
``linear_qkv`` or ``linear_fc1`` has an adapter: no error, a silently worse fine-tune. TE 1.5 to
2.3 drop it too in a layer with Userbuffers overlap of the input gradient's reduce-scatter
(``ub_overlap_rs_dgrad`` or ``ub_bulk_wgrad``): the add sits in the branch those skip (v2.3 L690-696).

The patch wraps ``AdapterWrapper.base_linear_forward``: for a wrapper whose TE LayerNorm-linear was
set up to return the gathered norm output and whose TE drops its gradient, it asks TE for the
local shard instead (the branch whose gradient TE adds in every version, Userbuffers or not, v2.3
L810-813) and all-gathers it with Megatron Core's ``gather_from_sequence_parallel_region``, whose
backward reduce-scatters the gradient. The adapters get the same gathered tensor as before (one per
wrapper, shared by CanonicalLoRA's adapters) and autograd keeps the same tensors; the cost is one
all-gather in forward and one reduce-scatter in backward of [s, b, h] per such layer. Wrappers that
already use the shard (Bridge's ``sequence_parallel_input_regather``, megatron_bridge_ext's
strategies) and adapters that gather by themselves are left alone. Under FP8 TE returns the norm
output unquantised in both modes (v2.4 L218-245), so the same holds.

The gate follows the code it relies on, not a Bridge version list: Bridge's ``AdapterWrapper`` with
its own ``base_linear_forward``, Bridge's ``get_adapter_attributes_from_linear`` setting
``return_layernorm_output_gathered``, and at a layer's first forward the TE attributes it reads
(the flags, ``sequence_parallel``, the TP group). Where one is missing the patch changes nothing
and says so at WARNING, naming what is missing (status ``refused``).

The run-time check (:func:`install_check`, installed by ``megatron_bridge_ext.init()``) looks at
each wrapper once, after its first forward: a TE LayerNorm-linear still returning the gathered norm
output under SP on a TE that drops its gradient means the fix is not active there, and one WARNING
says so. It warns rather than refuses: Bridge's path as shipped is what ``scripts/te_lora_grad_check.py``
runs on purpose, and the training still runs (the LoRA weights' own gradients are right). A layer
the fix cannot make right is refused by both (:func:`userbuffers_refusal`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from typing import Callable, Optional

from packaging.version import InvalidVersion, Version

from megatron_bridge_ext import versions
from megatron_bridge_ext.patches import import_hooks
from megatron_bridge_ext.patches.base import Patch

log = logging.getLogger("megatron_bridge_ext.patches")

TARGET_MODULE = "megatron.bridge.peft.adapter_wrapper"
UTILS_MODULE = "megatron.bridge.peft.utils"
FIRST_AFFECTED_TE = Version("2.4.0.dev0")
"""TE's version was already 2.4.0.dev0 before ce0b46c4d: every 2.4 dev build counts as affected."""
FIRST_GATHERED_RETURN_TE = Version("1.5.0.dev0")
"""TE 1.5 added ``return_layernorm_output_gathered``; Bridge sets it from that version on."""
USERBUFFERS_DROPPING = ("ub_overlap_rs_dgrad", "ub_bulk_wgrad")
"""TE <= 2.3 skips the gathered-output add in these modes (v2.3 L690-692)."""

_DECISION = "_mbx_gather_norm_output"
_LAYER_CHECKED = "_mbx_te_layer_checked"
_CHECKED = "_mbx_te_grad_checked"
_FIX = ("use megatron_bridge_ext.peft.LoRA (or DoRA, CanonicalLoRA) with sequence_parallel_input_strategy="
        "\"regather\" or \"shard_local\", which take TE's non-gathered norm output, or a megatron-bridge-ext "
        "release that knows this Bridge")


def te_affected() -> tuple[bool, str]:
    """Whether the installed Transformer Engine drops the gradient of a gathered returned norm output in every layer."""
    version = versions.installed_version("transformer-engine")
    if version is None:
        return False, "Transformer Engine is not installed"
    if version >= FIRST_AFFECTED_TE:
        return True, f"Transformer Engine {version} (>= 2.4) drops the gradient of a gathered returned norm output"
    return False, f"Transformer Engine {version} (< 2.4) adds the gradient of the gathered norm output itself"


def te_version_in_use() -> Optional[Version]:
    """The imported Transformer Engine's own version, else the installed one (TE's layers run in this process)."""
    text = getattr(sys.modules.get("transformer_engine"), "__version__", None)
    try:
        return Version(text) if text else versions.installed_version("transformer-engine")
    except InvalidVersion:
        return versions.installed_version("transformer-engine")


def drops_gathered_grad(base, te_version: Optional[Version]) -> Optional[str]:
    """Why TE drops the gradient of ``base``'s gathered returned norm output, or None when it adds it."""
    if te_version is None or te_version < FIRST_GATHERED_RETURN_TE:
        return None
    if te_version >= FIRST_AFFECTED_TE:
        return f"Transformer Engine {te_version} (>= 2.4) drops the gradient of a gathered returned norm output"
    overlaps = [name for name in USERBUFFERS_DROPPING if getattr(base, name, False)]
    if overlaps:
        return (f"Transformer Engine {te_version} (<= 2.3) with Userbuffers {' and '.join(overlaps)} skips the "
                "gradient of a gathered returned norm output (layernorm_linear.py v2.3 L690-696)")
    return None


def userbuffers_refusal(base) -> Optional[str]:
    """Why no fix can make ``base``'s input gradient right: TE's bulk wgrad overlap with a frozen weight.

    With ``ub_bulk_wgrad`` TE reduce-scatters the input gradient inside the weight-gradient GEMM
    (v2.3 L792-796, v2.4 L873-877), which runs only for a trainable weight (v2.3 L708, v2.4 L748).
    With LoRA's frozen base TE 2.3 then fails on the unreduced buffer (v2.3 L811) and TE >= 2.4
    takes its local chunk unreduced (v2.4 L722-723): a wrong input gradient in any mode.
    """
    weight = getattr(base, "weight", None)
    if getattr(base, "ub_bulk_wgrad", False) and weight is not None and not weight.requires_grad:
        return (f"{type(base).__name__} has Userbuffers ub_bulk_wgrad with a frozen weight (LoRA's base): Transformer "
                "Engine reduce-scatters its input gradient inside the weight-gradient GEMM, which a frozen weight "
                "skips, so the input gradient is never reduced. Fix: set model.tp_comm_bulk_wgrad=False")
    return None


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def structure_problems(adapter_wrapper, peft_utils) -> list[str]:
    """What the patch relies on in Bridge and does not find; empty when all of it is there.

    ``peft_utils`` may be None (it did not import). TE's per-layer attributes are checked at a
    layer's first forward (:func:`_tp_group`), where the layer exists.
    """
    problems = []
    cls = getattr(adapter_wrapper, "AdapterWrapper", None)
    if cls is None:
        problems.append(f"{TARGET_MODULE} has no AdapterWrapper")
    elif not callable(cls.__dict__.get("base_linear_forward")):
        problems.append(f"{TARGET_MODULE}.AdapterWrapper defines no base_linear_forward (where the adapters get "
                        "the norm output)")
    setter = getattr(peft_utils, "get_adapter_attributes_from_linear", None)
    if setter is None:
        problems.append(f"{UTILS_MODULE} has no get_adapter_attributes_from_linear")
    elif "return_layernorm_output_gathered" not in _source(setter):
        problems.append(f"{UTILS_MODULE}.get_adapter_attributes_from_linear no longer sets "
                        "return_layernorm_output_gathered (how Bridge feeds LoRA-A the norm output has changed)")
    return problems


def _peft_utils():
    if UTILS_MODULE in sys.modules:
        return sys.modules[UTILS_MODULE]
    try:
        return importlib.import_module(UTILS_MODULE)
    except ImportError:
        return None


def _adapters_gather_themselves(wrapper) -> bool:
    """True when an adapter of ``wrapper`` all-gathers its own input (then it must get the shard)."""
    from megatron.bridge.peft.utils import ParallelLinearAdapter

    return any(isinstance(m, ParallelLinearAdapter) and not m.disable_sequence_parallel_comm
               for m in wrapper.adapter.modules())


def _returns_gathered(base) -> bool:
    return bool(getattr(base, "return_layernorm_output", False)
                and getattr(base, "return_layernorm_output_gathered", False)
                and getattr(base, "sequence_parallel", False))


def _tp_group(base):
    """The TP group of a TE layer (Core's name, then TE's); refuses loudly when it has neither."""
    from megatron_bridge_ext.findings import ERROR, Finding, Refused

    group = getattr(base, "_tp_group", None) or getattr(base, "tp_group", None)
    if group is None:
        raise Refused("bridge_lora_te_norm_grad", [Finding(
            "te_structure", ERROR, type(base).__name__,
            "returns its gathered norm output under sequence parallelism but has no tp_group attribute to gather "
            "the shard over; Transformer Engine's layer is not shaped as this patch expects", _FIX)])
    return group


def _refuse_layer(base) -> None:
    from megatron_bridge_ext.findings import ERROR, Finding, Refused

    reason = userbuffers_refusal(base)
    if reason is not None:
        message, fix = reason.split(" Fix: ")
        raise Refused("LoRA on a Transformer Engine LayerNorm-linear", [Finding(
            "te_userbuffers_frozen_wgrad", ERROR, "model.tp_comm_bulk_wgrad", message, fix)])


def _decide(wrapper) -> bool:
    """At a wrapper's first forward: does its base return the gathered norm output under SP on a TE that drops it?"""
    base = wrapper.to_wrap
    if not _returns_gathered(base) or drops_gathered_grad(base, te_version_in_use()) is None:
        return False
    _tp_group(base)
    return True


class _Installed:
    """The one wrapper on ``AdapterWrapper.base_linear_forward``, shared by the fix and the check.

    Either can be turned on and off without unwrapping the other; upstream's method is put back
    when neither is on.
    """

    def __init__(self) -> None:
        self.fix = self.check = False
        self.cls = self.original = self.wrapper = None
        self.logged = self.warned = False

    def ensure(self, cls) -> None:
        """Our wrapper on ``cls``; wrapped again when the class or its method was replaced since (a re-imported
        Bridge module, or code that put another method there), so the fix and the check never sit unused."""
        if self.cls is cls and cls.__dict__.get("base_linear_forward") is self.wrapper:
            return
        self.cls, self.original = cls, cls.__dict__["base_linear_forward"]
        self.wrapper = cls.base_linear_forward = _wrap(self.original)

    def release(self) -> None:
        if self.cls is None or self.fix or self.check:
            return
        if self.cls.__dict__.get("base_linear_forward") is self.wrapper:
            self.cls.base_linear_forward = self.original
        self.cls = self.original = self.wrapper = None


_INSTALLED = _Installed()
_REFUSAL: list[str] = []


def _gathered_by_us(original: Callable, wrapper, x, args, kwargs):
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    base = wrapper.to_wrap
    base.return_layernorm_output_gathered = False  # Bridge's conversion code may set it back: every call
    linear_output, bias, layernorm_output = original(wrapper, x, *args, **kwargs)
    if not _adapters_gather_themselves(wrapper):
        layernorm_output = gather_from_sequence_parallel_region(layernorm_output, group=_tp_group(base))
    return linear_output, bias, layernorm_output


def _first_forward(wrapper) -> None:
    """Until a wrapper passes once: refuse a layer no fix can make right."""
    if not wrapper.__dict__.get(_LAYER_CHECKED):
        _refuse_layer(wrapper.to_wrap)
        wrapper.__dict__[_LAYER_CHECKED] = True


def _check(wrapper) -> None:
    """After a wrapper's first forward: warn once per process when its adapters got a gathered norm output TE drops."""
    wrapper.__dict__[_CHECKED] = True
    base = wrapper.to_wrap
    reason = drops_gathered_grad(base, te_version_in_use()) if _returns_gathered(base) else None
    if reason is None or _INSTALLED.warned:
        return
    _INSTALLED.warned = True
    status, why = PATCH.status()
    name = getattr(wrapper.adapter, "base_linear_name", None) or type(base).__name__
    log.warning("LoRA on %s (a Transformer Engine LayerNorm-linear under sequence parallelism) gets the gathered norm "
                "output, and %s: the LoRA branch's input gradient is lost in every such layer and training goes on "
                "with wrong gradients (patch bridge_lora_te_norm_grad: %s, %s; logged once). Fix: call "
                "megatron_bridge_ext.init() first in the training script (or launch with `mbx run -- torchrun ...`), "
                "or use megatron_bridge_ext.peft.LoRA (DoRA, CanonicalLoRA)", name, reason, status, why)


def _wrap(original: Callable) -> Callable:
    def base_linear_forward(self, x, *args, **kwargs):
        if _INSTALLED.fix or _INSTALLED.check:
            _first_forward(self)
        result = None
        if _INSTALLED.fix:
            decision = self.__dict__.get(_DECISION)
            if decision is None:
                decision = self.__dict__[_DECISION] = _decide(self)
                if decision and not _INSTALLED.logged:
                    _INSTALLED.logged = True
                    log.info("LoRA on a TE LayerNorm-linear under sequence parallelism: the norm output is returned "
                             "as the local shard and all-gathered by megatron_bridge_ext, because Transformer Engine "
                             "drops the gradient of a gathered return here (logged once)")
            if decision:
                result = _gathered_by_us(original, self, x, args, kwargs)
        if result is None:
            result = original(self, x, *args, **kwargs)
        if _INSTALLED.check and not self.__dict__.get(_CHECKED):
            _check(self)
        return result

    base_linear_forward.__doc__ = original.__doc__
    base_linear_forward.__wrapped__ = original
    return base_linear_forward


def _install_fix(adapter_wrapper) -> None:
    problems = structure_problems(adapter_wrapper, _peft_utils())
    if problems:
        bridge = versions.installed_version("megatron-bridge")
        _REFUSAL[:] = [f"Megatron Bridge {bridge}: " + "; ".join(problems) + ": nothing changed. Fix: " + _FIX]
        log.warning("patch bridge_lora_te_norm_grad refused: %s", _REFUSAL[0])
        return
    _INSTALLED.ensure(adapter_wrapper.AdapterWrapper)
    _INSTALLED.fix = True


def _needed() -> tuple[bool, str]:
    version = versions.installed_version("transformer-engine")
    if version is None:
        return False, "Transformer Engine is not installed"
    if version < FIRST_GATHERED_RETURN_TE:
        return False, f"Transformer Engine {version} (< 1.5) cannot return a gathered norm output"
    if version >= FIRST_AFFECTED_TE:
        return te_affected()
    return True, (f"Transformer Engine {version} (1.5 to 2.3) drops the gradient of a gathered returned norm output "
                  f"only in layers with Userbuffers {' or '.join(USERBUFFERS_DROPPING)}: the patch takes over those")


def _apply() -> Callable[[], None]:
    remove_hook = import_hooks.after_import(TARGET_MODULE, _install_fix)

    def undo() -> None:
        remove_hook()
        _REFUSAL.clear()
        _INSTALLED.fix = False
        _INSTALLED.release()

    return undo


_CHECK_HOOK: list[Callable[[], None]] = []


def _install_check(adapter_wrapper) -> None:
    cls = getattr(adapter_wrapper, "AdapterWrapper", None)
    if cls is not None and callable(cls.__dict__.get("base_linear_forward")):  # else the patch's refusal says why
        _INSTALLED.ensure(cls)
        _INSTALLED.check = True


def install_check() -> Callable[[], None]:
    """Check each Bridge adapter wrapper once, at its first forward (idempotent; importing Bridge is left to the
    script). Returns the function that removes the check."""
    if not _CHECK_HOOK:
        _CHECK_HOOK.append(import_hooks.after_import(TARGET_MODULE, _install_check))
    return remove_check


def remove_check() -> None:
    """Remove the run-time check (a no-op when it is not installed)."""
    while _CHECK_HOOK:
        _CHECK_HOOK.pop()()
    _INSTALLED.check = _INSTALLED.warned = False
    _INSTALLED.release()


def check_installed() -> bool:
    return bool(_CHECK_HOOK)


PATCH = Patch(
    name="bridge_lora_te_norm_grad",
    target=f"{TARGET_MODULE}.AdapterWrapper.base_linear_forward",
    distribution="megatron-bridge",
    versions=">=0.5.1",
    reason="with Transformer Engine >= 2.4 (TE commit ce0b46c4d), and TE 1.5-2.3 under Userbuffers rs_dgrad/bulk_wgrad "
           "overlap, the LoRA branch's input gradient is dropped when Bridge feeds LoRA-A TE's gathered LayerNorm "
           "output under sequence parallelism; gated on the code it patches (refused, with a warning, when it changed)",
    applied_by="megatron_bridge_ext.init() and `mbx run` (an import hook on Bridge's adapter_wrapper, with a run-time "
               "check that warns once when a layer still drops the gradient), megatron_bridge_ext.peft's LoRA, DoRA "
               "and CanonicalLoRA when they transform a model, and MemoryConfig.apply for any LoRA-family cfg.peft "
               "(Bridge's own included)",
    needed=_needed,
    do_apply=_apply,
    refusal=lambda: _REFUSAL[0] if _REFUSAL else None,
)
