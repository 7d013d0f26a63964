"""The contract every patch follows: target, version range, reason, apply/revert."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from packaging.specifiers import SpecifierSet

from megatron_bridge_ext.versions import installed_version

logger = logging.getLogger("megatron_bridge_ext.patches")

APPLIED = "applied"
NOT_NEEDED = "not needed"
OUT_OF_RANGE = "out of range"
NOT_APPLIED = "not applied"
REFUSED = "refused"
"""Applied, but the upstream code it changes is not shaped as the patch expects: it changed nothing and said so."""


@dataclass
class Patch:
    """One reversible, version-gated change to upstream behaviour.

    ``needed`` says whether the installed environment shows the upstream problem;
    ``do_apply`` makes the change and returns an undo callable. ``apply()`` is idempotent.
    ``applied_by`` says which feature applies it, and when: no patch is applied by importing
    the package. ``refusal`` (optional) says, once the target is imported, why the patch left it
    alone (its structure is not what the patch relies on); None while nothing was refused.
    """

    name: str
    target: str
    distribution: str
    versions: str
    reason: str
    applied_by: str
    needed: Callable[[], tuple[bool, str]]
    do_apply: Callable[[], Callable[[], None]]
    refusal: Callable[[], str | None] = field(default=lambda: None, repr=False)
    _undo: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def applied(self) -> bool:
        return self._undo is not None

    def in_range(self) -> tuple[bool, str]:
        version = installed_version(self.distribution)
        if version is None:
            return False, f"{self.distribution} is not installed"
        if version not in SpecifierSet(self.versions):
            return False, f"{self.distribution} {version} is outside {self.versions}; nothing applied"
        return True, f"{self.distribution} {version}"

    def status(self) -> tuple[str, str]:
        """(status, why) without changing anything."""
        ok, why = self.in_range()
        if not ok:
            return OUT_OF_RANGE, why
        if self.applied:
            refused = self.refusal()
            return (REFUSED, refused) if refused else (APPLIED, why)
        is_needed, why_needed = self.needed()
        return (NOT_APPLIED if is_needed else NOT_NEEDED), why_needed

    def apply(self, *, quiet: bool = False) -> tuple[str, str]:
        """Apply when in range and needed; idempotent. Returns (status, why); ``quiet`` logs at DEBUG."""
        if self.applied:
            refused = self.refusal()
            return (REFUSED, refused) if refused else (APPLIED, "already applied")
        ok, why = self.in_range()
        if not ok:
            logger.info("patch %s: %s", self.name, why)
            return OUT_OF_RANGE, why
        is_needed, why_needed = self.needed()
        if not is_needed:
            return NOT_NEEDED, why_needed
        self._undo = self.do_apply()
        refused = self.refusal()
        if refused:
            return REFUSED, refused  # the patch logged it as a warning when it refused
        logger.log(logging.DEBUG if quiet else logging.INFO, "patch %s applied to %s (%s)", self.name, self.target, why)
        return APPLIED, why_needed

    def revert(self) -> None:
        """Undo ``apply()``; a no-op when not applied."""
        if self._undo is not None:
            self._undo()
            self._undo = None
