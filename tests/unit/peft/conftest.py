"""Our PEFT classes as module-scoped fixtures (their upstream patches reverted after each module)."""

from tests.support.peft import classes, ours  # noqa: F401
