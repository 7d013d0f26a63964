"""verify_allocator on a CPU: the configuration, said to be unverified."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.levers.allocator import ALLOC_VAR, CUDA_VAR, verify_allocator
from tests.support.allocator import ES

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------------------------
# verify_allocator on CPU
# --------------------------------------------------------------------------------------------


def test_verify_on_cpu_reports_the_configuration_and_says_it_is_not_verified():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    on = verify_allocator(environ={ALLOC_VAR: ES})
    assert on.on_device is False and on.configured is True and on.in_effect is None
    assert "not verified on a device" in on.message and ALLOC_VAR in on.message
    off = verify_allocator(environ={CUDA_VAR: "", ALLOC_VAR: ES})
    assert off.configured is False
