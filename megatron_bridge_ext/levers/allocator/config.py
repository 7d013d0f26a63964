"""The allocator lever's flags, its checks and how it sets a Bridge config's ``env_vars``."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge_ext.findings import Finding
from megatron_bridge_ext.levers.change import Change

FLAGS = ("expandable_segments", "allocator_ipc")


@dataclass(kw_only=True)
class AllocatorConfig:
    """expandable_segments: PyTorch's ``expandable_segments:True`` allocator option via ``cfg.env_vars``
    (set before CUDA starts, user options kept). allocator_ipc: the processes share CUDA memory through
    IPC (colocated inference, weight sync): expandable segments are then left off."""

    expandable_segments: bool = True
    allocator_ipc: bool = False

    def __post_init__(self) -> None:
        for name in FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"MemoryConfig.{name}={value!r} is not a bool. Fix: write {name}=True or "
                                 f"{name}=False")

    def findings(self, cfg) -> list[Finding]:
        if not self.expandable_segments:
            return []
        from megatron_bridge_ext.levers.allocator.apply import bridge_env_findings

        return bridge_env_findings(cfg, ipc=self.allocator_ipc)[1]

    def apply(self, cfg) -> list[Change]:
        """Write the allocator variables into ``cfg.env_vars`` (Bridge sets them before CUDA starts); with
        ``expandable_segments=False``, turn off the ones the config's ``env_vars`` turn on (a recipe's), keeping every
        other option there."""
        if not self.expandable_segments:
            return _turn_off(cfg)
        from megatron_bridge_ext.levers.allocator.apply import configure_bridge_env

        before = dict(getattr(cfg, "env_vars", None) or {})  # Bridge 0.5.1 has no env_vars field
        configure_bridge_env(cfg, ipc=self.allocator_ipc)
        return [Change(f"env_vars.{name}", before.get(name), new)
                for name, new in cfg.env_vars.items() if before.get(name) != new]


def _turn_off(cfg) -> list[Change]:
    """``expandable_segments:False`` in each allocator variable of ``cfg.env_vars`` that turns them on; the other
    options of the variable stay as they are."""
    from megatron_bridge_ext.levers.allocator.options import VARIABLES, AllocConf

    env = getattr(cfg, "env_vars", None) or {}
    changes = []
    for name in VARIABLES:
        if name not in env:
            continue
        conf = AllocConf.parse(str(env[name]), name)
        if conf.flag("expandable_segments"):
            new = conf.with_option("expandable_segments", "False").render()
            changes.append(Change(f"env_vars.{name}", env[name], new))
            env[name] = new
    return changes
