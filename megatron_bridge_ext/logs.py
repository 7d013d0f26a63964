"""Logging for our commands: our own decisions at INFO, upstream import chatter silenced."""

from __future__ import annotations

import logging
import os
import warnings

# Messages upstream emits on every import on machines without Apex/TE; they say nothing about a run.
_IMPORT_NOISE = (
    r".*Apex is not installed.*",
    r".*Transformer Engine and Apex are not installed.*",
    r".*absl\.logging is not installed.*",
    r".*is deprecated\. Please use `torch\.distributed\..*",
)


def configure() -> None:
    """INFO for ``megatron_bridge_ext`` (what was applied), WARNING for upstream (``MBX_LOG_LEVEL`` overrides)."""
    level = os.environ.get("MBX_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron_bridge_ext").setLevel(level)
    for name in ("megatron", "megatron.bridge", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in _IMPORT_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
