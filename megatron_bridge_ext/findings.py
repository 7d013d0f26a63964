"""One kind of finding for every check the package makes, and one error that refuses a setting.

Every validation (``MemoryConfig.validate``, the allocator guards, the LoRA eligibility rules where
they report) speaks in :class:`Finding` objects: a stable ``code``, a ``level`` that says what the
finding means for the run, the ``setting`` it is about, a ``message`` and the ``fix``. A check that
cannot let the run go ahead raises :class:`Refused`, which carries its error findings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

ERROR = "error"
"""The run cannot go ahead as configured: it would fail later or misbehave. Raised as :class:`Refused`."""
WARNING = "warning"
"""The run goes ahead, but a setting costs memory or speed, or does not do what it seems to."""
NO_EFFECT = "no effect"
"""A requested feature does nothing under this configuration (said so rather than silently ignored)."""
ACTION = "action"
"""Something was set on the user's behalf because a requested feature requires it."""

LEVELS = (ERROR, WARNING, NO_EFFECT, ACTION)


@dataclass(frozen=True)
class Finding:
    """One result of a check: what it is about, what it means, how to fix it."""

    code: str
    level: str
    setting: str
    message: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"Finding.level={self.level!r} is not one of {LEVELS}")

    def text(self) -> str:
        """``setting: message. Fix: fix`` (without the level); the message ends in a full stop before the fix."""
        return f"{self.setting}: " + (joined(self.message, self.fix) if self.fix else self.message)

    def __str__(self) -> str:
        return f"[{self.level}] {self.text()}"

    def to_dict(self) -> dict:
        return asdict(self)


def _stop(message: str) -> str:
    """The full stop a message needs before ``Fix:`` (none when it already ends a sentence)."""
    return "" if message.rstrip().endswith((".", "!", "?")) else "."


def joined(message: str, fix: str) -> str:
    """``message. Fix: fix``: every refusal of the package joins its message and fix this way."""
    return f"{message}{_stop(message)} Fix: {fix}"


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == ERROR]


class Refused(ValueError):
    """A setting cannot work; ``findings`` holds each error with the setting it names and its fix."""

    def __init__(self, what: str, findings: list[Finding]):
        self.what = what
        self.findings = list(findings)
        super().__init__(f"{what} refused:\n" + "\n".join(f"  - {f.text()}" for f in self.findings))

    def one_line(self) -> str:
        """Every error on one line (``setting: message. Fix: fix; also: ...``), the first one first."""
        if not self.findings:
            return self.what
        return "; also: ".join(f.text() for f in self.findings)
