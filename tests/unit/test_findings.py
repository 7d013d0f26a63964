"""A finding's text: the setting, the message and the fix."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("message, text", [
    ("TP=3 does not divide the 32 attention heads", "s: TP=3 does not divide the 32 attention heads. Fix: f"),
    ("ends a sentence.", "s: ends a sentence. Fix: f"),
])
def test_a_finding_puts_a_full_stop_before_its_fix(message, text):
    from megatron_bridge_ext.findings import ERROR, Finding

    assert Finding("c", ERROR, "s", message, "f").text() == text
    assert Finding("c", ERROR, "s", message).text() == f"s: {message}"
