"""What the running torch says about its allocator, and its run-time setter.

Everything here imports torch when called (never at import): the state of a live process, used by
the setup (to hand settings to a torch that already read them), the verification and the OOM
handler.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping, Optional

from megatron_bridge_ext.levers.allocator.options import VARIABLES, effective, parse_version
from megatron_bridge_ext.findings import ERROR, Finding

EARLIER = ("call megatron_bridge_ext.init() as the first line of the training script (before anything "
           "touches CUDA), or launch with `mbx run -- torchrun ...`")


def torch_imported() -> bool:
    return "torch" in sys.modules


def cuda_initialized() -> bool:
    """True when this process's torch has initialised CUDA (False when torch is not imported)."""
    if not torch_imported():
        return False
    import torch

    return bool(torch.cuda.is_initialized())


def cuda_initialized_finding(setting: str, what: str) -> Optional[Finding]:
    """An error finding when CUDA already runs in this process, so allocator variables come too late."""
    if not cuda_initialized():
        return None
    return Finding("cuda_initialized", ERROR, setting, f"CUDA is already initialised: {what}", EARLIER)


def setter() -> tuple[Optional[Callable[[str], None]], Optional[str]]:
    """torch's run-time allocator-settings setter and its name, or (None, None)."""
    import torch

    fn = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if fn is not None:
        return fn, "torch._C._accelerator_setAllocatorSettings"
    fn = getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)  # older torch
    if fn is not None:
        return fn, "torch.cuda.memory._set_allocator_settings"
    return None, None


def getter() -> Optional[Callable[[], str]]:
    """torch's run-time allocator-settings getter (torch >= 2.9), or None."""
    import torch

    return getattr(torch._C, "_accelerator_getAllocatorSettings", None)


def state(environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """This process's allocator variables, what torch reports, and whether expandable segments are configured."""
    import torch

    env = os.environ if environ is None else environ
    result: dict[str, Any] = {name: env.get(name) for name in VARIABLES}
    get = getter()
    result["torch_settings"] = get() if get else None
    try:
        conf = effective(env, parse_version(torch.__version__))[1]
        result["expandable_segments"] = bool(conf.flag("expandable_segments"))
    except ValueError as error:
        result["expandable_segments"] = None
        result["error"] = str(error)
    return result
