"""Test-only helpers. Never imported by the ``megatron_bridge_ext`` package."""
