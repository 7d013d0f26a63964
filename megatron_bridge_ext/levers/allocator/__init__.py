"""Turn on PyTorch's expandable segments before CUDA starts, keeping every option the user set.

Why: most out-of-memory errors near the limit come from the caching allocator's fragmentation
(free memory held in segments that live blocks keep split), not from capacity. Expandable
segments remove most of it at no throughput cost. The option must be in place before CUDA is
initialised, must not clobber the user's options, and does not go with a few features; those
are checked before launch.

The folder follows the data: :mod:`.options` parses and renders the option strings and knows
which variable torch reads (pure); :mod:`.guards` holds the checks; :mod:`.env_plan` decides what to
write (pure); :mod:`.apply` writes it (``init()``, ``mbx run``, a Bridge config's ``env_vars``);
:mod:`.runtime` talks to a running torch; :mod:`.verify` proves the result on a device.

Three ways in, all backed by :func:`plan_allocator`:

* :func:`init` (``megatron_bridge_ext.init()``) as the first call of a training script;
* :func:`configure_bridge_env` fills a Bridge ``ConfigContainer.env_vars`` (Bridge applies them
  with ``os.environ.setdefault`` in ``runtime_config_update``, so shell values win);
* ``mbx run -- torchrun ...`` sets the environment, then executes the launcher.

Importing this package does not import torch (it must run before torch reads the variables).
"""

from megatron_bridge_ext.levers.allocator.apply import AllocatorResult, configure_bridge_env, init, setup_allocator
from megatron_bridge_ext.levers.allocator.options import ALLOC_VAR, CUDA_VAR, AllocConf, AllocatorConfigError
from megatron_bridge_ext.levers.allocator.env_plan import AllocatorPlan, installed_torch_version, plan_allocator, plan_bridge_env
from megatron_bridge_ext.levers.allocator.verify import AllocatorVerification, verify_allocator

__all__ = [
    "ALLOC_VAR", "CUDA_VAR", "AllocConf", "AllocatorConfigError", "AllocatorPlan", "AllocatorResult",
    "AllocatorVerification", "configure_bridge_env", "init", "installed_torch_version", "plan_allocator",
    "plan_bridge_env", "setup_allocator", "verify_allocator",
]
