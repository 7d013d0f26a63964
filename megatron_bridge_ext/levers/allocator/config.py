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
        """Write the allocator variables into ``cfg.env_vars`` (Bridge sets them before CUDA starts)."""
        if not self.expandable_segments:
            return []
        from megatron_bridge_ext.levers.allocator.apply import configure_bridge_env

        before = dict(getattr(cfg, "env_vars", None) or {})  # Bridge 0.5.1 has no env_vars field
        configure_bridge_env(cfg, ipc=self.allocator_ipc)
        return [Change(f"env_vars.{name}", before.get(name), new)
                for name, new in cfg.env_vars.items() if before.get(name) != new]
