"""The user's choice and every guard of the allocator setup (CPU only)."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.levers.allocator import ALLOC_VAR, CUDA_VAR, setup_allocator
from megatron_bridge_ext.findings import Refused
from tests.support.allocator import ES, NEW, codes, plan

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------------------------
# User choice and guards
# --------------------------------------------------------------------------------------------


def test_explicit_false_wins_with_a_warning_that_says_the_cost():
    p = plan({ALLOC_VAR: "expandable_segments:False"})
    assert p.changes == {} and p.expandable_segments is False
    (warning,) = p.findings
    assert warning.code == "user_disabled" and "58.8 GB" in warning.message and "-28.4%" in warning.message
    # The fix names the cases that need it off, not guards "below" (the warning may be the only finding printed).
    assert "below" not in warning.fix and "ddp.nccl_ub" in warning.fix and "IPC" in warning.fix


def test_explicit_true_is_left_alone():
    p = plan({CUDA_VAR: ES})
    assert p.changes == {} and p.expandable_segments is True


def test_duplicate_key_is_reported_and_the_last_value_decides():
    p = plan({ALLOC_VAR: "expandable_segments:True,expandable_segments:False"})
    assert p.changes == {}
    assert codes(p.findings) == ["duplicate_key", "user_disabled"]
    assert "expandable_segments:False" in p.findings[0].message


@pytest.mark.parametrize("version, refused", [("2.10.1", True), ("2.11.0", False), (NEW, False)])
def test_nccl_ub_with_expandable_segments_before_torch_2_11_is_refused_before_launch(version, refused):
    if not refused:
        assert plan({}, version, nccl_ub=True).errors == []
        return
    with pytest.raises(Refused) as info:
        setup_allocator({}, torch_version=version, nccl_ub=True)
    message = str(info.value)
    assert "ddp.nccl_ub" in message and "expandable_segments:False" in message and "torch >= 2.11" in message


def test_nccl_ub_with_user_choice_false_is_fine():
    p = plan({ALLOC_VAR: "expandable_segments:False"}, "2.10.1", nccl_ub=True)
    assert p.errors == []


def test_cuda_graphs_set_nccl_graph_register_when_absent():
    p = plan({}, cuda_graph_impl="transformer_engine")
    assert p.changes["NCCL_GRAPH_REGISTER"] == (None, "0")
    env = {}
    setup_allocator(env, torch_version=NEW, cuda_graph_impl="local")
    assert env == {ALLOC_VAR: ES, "NCCL_GRAPH_REGISTER": "0"}


def test_cuda_graphs_accept_zero_and_refuse_another_user_value():
    assert "NCCL_GRAPH_REGISTER" not in plan({"NCCL_GRAPH_REGISTER": "0"}, cuda_graph_impl="local").changes
    env = {"NCCL_GRAPH_REGISTER": "1"}
    with pytest.raises(Refused, match="NCCL_GRAPH_REGISTER.*is '1'"):
        setup_allocator(env, torch_version=NEW, cuda_graph_impl="local")
    assert env == {"NCCL_GRAPH_REGISTER": "1"}


def test_cuda_graphs_off_or_expandable_off_leave_nccl_graph_register_alone():
    assert "NCCL_GRAPH_REGISTER" not in plan({}, cuda_graph_impl="none").changes
    assert plan({"NCCL_GRAPH_REGISTER": "1", ALLOC_VAR: "expandable_segments:False"},
                cuda_graph_impl="local").errors == []


def test_cuda_malloc_async_is_not_given_expandable_segments():
    p = plan({CUDA_VAR: "backend:cudaMallocAsync"})
    assert p.changes == {} and p.expandable_segments is False
    assert codes(p.findings, "warning") == ["cuda_malloc_async"]
    assert "ignores expandable_segments" in p.findings[0].message


def test_cuda_malloc_async_with_explicit_expandable_segments_is_refused():
    with pytest.raises(Refused, match="backend:cudaMallocAsync"):
        setup_allocator({CUDA_VAR: "backend:cudaMallocAsync," + ES}, torch_version=NEW)


def test_max_split_size_with_expandable_segments_warns_but_keeps_both():
    p = plan({ALLOC_VAR: "max_split_size_mb:512"})
    assert p.changes[ALLOC_VAR][1] == "max_split_size_mb:512," + ES
    (warning,) = [f for f in p.findings if f.level == "warning"]
    assert warning.code == "max_split_size" and "without bound" in warning.message


def test_ipc_processes_keep_expandable_segments_off():
    p = plan({}, ipc=True)
    assert p.changes == {} and p.expandable_segments is False
    assert codes(p.findings) == ["ipc"] and "MBX_ALLOCATOR_IPC" in p.findings[0].setting
    env = {"MBX_ALLOCATOR_IPC": "1"}
    result = setup_allocator(env, torch_version=NEW)
    assert result.changes == {} and ALLOC_VAR not in env


def test_ipc_with_explicit_expandable_segments_warns():
    p = plan({CUDA_VAR: ES}, ipc=True)
    assert p.expandable_segments is True and "cannot" not in p.findings[0].message
    assert "sharing an expandable-segment tensor fails" in p.findings[0].message


def test_ipc_env_value_must_be_yes_or_no():
    with pytest.raises(ValueError, match="MBX_ALLOCATOR_IPC='maybe'"):
        setup_allocator({"MBX_ALLOCATOR_IPC": "maybe"}, torch_version=NEW)
