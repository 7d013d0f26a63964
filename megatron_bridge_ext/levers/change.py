"""``Change``: one field a lever set on a Bridge config, with its old and new value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Change:
    field: str
    old: Any
    new: Any
    note: str = ""

    def __str__(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r}" + (f" ({self.note})" if self.note else "")
