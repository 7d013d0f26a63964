"""Our LoRA class as a module-scoped fixture (its upstream patches reverted after each module)."""

from tests.support.peft import ours  # noqa: F401
