"""Bridge's own estimate for the same config, next to ours."""

from __future__ import annotations

import pytest

from tests.support.estimate import DP

pytestmark = [pytest.mark.unit]


def test_bridge_estimate_ignores_peft_where_ours_does_not(qwen_lora):
    from megatron_bridge_ext.estimate.bridge import bridge_estimate

    cfg, est = qwen_lora
    with_lora = bridge_estimate(cfg, data_parallel_size=DP)
    peft, cfg.peft = cfg.peft, None
    try:
        without = bridge_estimate(cfg, data_parallel_size=DP)
    finally:
        cfg.peft = peft
    assert with_lora.total_bytes == without.total_bytes
    # Bridge charges every parameter 6 + 12/DP bytes; ours charges frozen ones their bf16 weight only.
    ours_state = sum(c.bytes for c in est.components if c.kind == "static")
    assert with_lora.components[0][1] > 3 * ours_state
