"""The MoE paged stash: Core's hook takes only the saved tensors TE stamps, and allocates no buffer when it recorded
none (checked on Core's own manager on CPU); the estimate counts that stash as nothing and refuses the one case where
TE's fused grouped MLP stamps what it saves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bridge_ext.estimate import features
from megatron_bridge_ext.estimate.features import paged_stash

pytestmark = [pytest.mark.unit]

TOKENS, HIDDEN, PAGE = 96, 16, 64


def _manager(status: str):
    """Core's ``PagedStashManager`` without its constructor (which makes a CUDA stream), in the state
    ``paged_stash_reset`` and ``get_paged_stash_context`` leave it in (paged_stash.py L395-438, L855-869)."""
    from megatron.core.transformer.moe.paged_stash import PagedStashManager

    manager = object.__new__(PagedStashManager)
    manager.__dict__.update(
        status=status, max_num_tokens=TOKENS, avg_num_tokens=TOKENS, num_tokens_tensor=torch.tensor(TOKENS),
        max_tokens_across_vp_stages=None, temp_tokens_across_vp_stages=None, max_avg_tokens_across_vp_stages=None,
        temp_avg_tokens_across_vp_stages=None, current_vp_stage=0, _pp_schedule=None, current_schedule_index=0,
        page_size=PAGE, paged_tensors_to_stash=[], overflow=None, host_spill=None, device=torch.device("cpu"),
        stash_buffers=None)
    return manager


def test_cores_hook_takes_only_the_stamped_saves():
    """A saved tensor without ``grouped_tensor_scale_inv`` comes back as it is; one TE stamped becomes Core's
    ``PagedTensor`` and is recorded by (dtype, width)."""
    from megatron.core.transformer.moe.paged_stash import PagedTensor

    manager = _manager("capture")
    plain = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    assert manager.on_save_for_backward(plain) is plain
    assert manager.max_tokens_across_vp_stages is None

    stamped = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    stamped.grouped_tensor_scale_inv = False
    assert isinstance(manager.on_save_for_backward(stamped), PagedTensor)
    assert manager.max_tokens_across_vp_stages == {(torch.bfloat16, HIDDEN): TOKENS}


def test_core_allocates_no_buffer_for_a_stash_that_recorded_nothing():
    """Iteration 2's allocation (``paged_stash_reset`` L908-915) after an iteration 1 with no stamped save: no buffer;
    after one stamped [96, 16] bf16 save, one buffer of 96 x 1.1 rows rounded up to 64-row pages."""
    empty = _manager("capture")
    empty.on_save_for_backward(torch.ones(TOKENS, HIDDEN))
    empty.allocate_stash_buffers(1.1, 0.0)
    assert empty.stash_buffers == {}

    recorded = _manager("capture")
    stamped = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    stamped.grouped_tensor_scale_inv = False
    recorded.on_save_for_backward(stamped)
    recorded.allocate_stash_buffers(1.1, 0.0)
    rows = -(-int(TOKENS * 1.1) // PAGE) * PAGE
    assert recorded.stash_buffers[torch.bfloat16][HIDDEN].cuda_buffer.shape == (rows, HIDDEN)


def _model(*, fuser=True, fp8=None, recipe=None, stash=True):
    return SimpleNamespace(moe_paged_stash=stash, use_transformer_engine_op_fuser=fuser, fp8=fp8, fp8_recipe=recipe,
                           num_moe_experts=8, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                           moe_expert_rank_capacity_factor=1.5 if stash else None)


@pytest.mark.parametrize("kwargs", [dict(), dict(fp8="hybrid", recipe="tensorwise"),
                                    dict(fp8="hybrid", recipe="delayed"), dict(fp8="hybrid", recipe="blockwise"),
                                    dict(fuser=False, fp8="hybrid", recipe="mxfp8")])
def test_a_stash_nothing_stamps_is_counted_as_nothing(kwargs):
    """bf16 experts, FP8 recipes TE does not fuse the grouped MLP for, or no op fuser: no refusal of the stash, and
    the estimate says it counts 0 B for it."""
    model = _model(**kwargs)
    assert paged_stash.findings(model) == []
    line = paged_stash.assumption(model)
    assert "0 B for the stash" in line and "grouped_tensor_scale_inv" in line


def test_the_stash_of_tes_fused_mxfp8_grouped_mlp_is_refused_by_name():
    model = _model(fp8="hybrid", recipe="mxfp8")
    [finding] = paged_stash.findings(model)
    assert finding.setting == "model.moe_paged_stash" and "grouped_mlp.py L1749" in finding.message
    assert paged_stash.assumption(model) is None


def test_no_stash_no_line_no_finding():
    model = _model(stash=False, fp8="hybrid", recipe="mxfp8")
    assert paged_stash.findings(model) == [] and paged_stash.assumption(model) is None


def test_the_estimate_asks_it():
    assert paged_stash in features.FEATURES
