"""Installed versions of torch, Megatron Core, Megatron Bridge and Transformer Engine, read from package
metadata (nothing is imported)."""

from __future__ import annotations

from importlib import metadata
from typing import Optional

from packaging.version import Version

DISTRIBUTIONS = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core",),
    "megatron-bridge": ("megatron-bridge",),
    "transformer-engine": ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12",
                           "transformer-engine-cu13"),
}


def installed_version(distribution: str) -> Optional[Version]:
    """Version of an installed distribution (or of any name it is published under), or None."""
    for name in DISTRIBUTIONS.get(distribution, (distribution,)):
        try:
            return Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    return None


def package_versions() -> dict[str, Optional[str]]:
    """The versions of the packages this extension works with; None when not installed."""
    return {label: (str(v) if (v := installed_version(label)) is not None else None) for label in DISTRIBUTIONS}
