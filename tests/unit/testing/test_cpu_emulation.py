"""The CPU emulation of Bridge's training loop: only the CPU runner imports it, every spelling of a CUDA device
lands on the CPU, and ``bridge_loop()`` puts back everything it replaced (the functional tests run Bridge in their
own process)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_bridge_ext.testing.cpu_emulation import CudaToCpu
from tests.support.fresh import run

pytestmark = [pytest.mark.unit]

PACKAGE = Path(__file__).resolve().parents[3] / "megatron_bridge_ext"


def _imports_cpu_emulation(path: Path) -> bool:
    """Whether ``path`` imports the module (``import ...cpu_emulation`` or ``from ... import cpu_emulation``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [getattr(node, "module", None) or ""] + [alias.name for alias in node.names]
            if any(name.split(".")[-1] == "cpu_emulation" for name in names):
                return True
    return False


def test_only_the_cpu_runner_and_the_gpu_check_dry_run_import_the_emulation():
    importers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _imports_cpu_emulation(p))
    # mbx demo / bench start CPU ranks through the runner; the GPU check's peak-memory and one-GPU parts install it
    # for their --dry-run on a CPU (the CPU rehearsal); no feature imports it
    assert importers == ["device_check/one_gpu.py", "device_check/peak_memory.py", "testing/cpu_run.py"]


def test_every_way_upstream_names_a_cuda_device_lands_on_the_cpu():
    with CudaToCpu():
        x = torch.tensor([1.0, 2.0], device="cuda")
        placed = {
            'torch.tensor(device="cuda")': x,
            "torch.zeros(device=torch.device('cuda', 0))": torch.zeros(2, device=torch.device("cuda", 0)),
            "Tensor.cuda(non_blocking=True)": x.cuda(non_blocking=True),
            'Tensor.to("cuda")': x.to("cuda"),
            'Tensor.to(device="cuda:0")': x.to(device="cuda:0"),
            "nn.Module.cuda()": torch.nn.Linear(2, 2).cuda().weight,
        }
        kept_dtype = x.to("cuda", torch.float64)
    assert {what: t.device.type for what, t in placed.items()} == {what: "cpu" for what in placed}
    assert kept_dtype.dtype == torch.float64 and kept_dtype.device.type == "cpu"
    assert torch.equal(placed['Tensor.to("cuda")'], torch.tensor([1.0, 2.0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulation is for machines without CUDA")
def test_bridge_loop_replaces_upstream_only_while_it_is_held():
    result = run("""
        from megatron_bridge_ext.testing import cpu_emulation

        cpu_emulation.install()
        cpu_emulation.bridge_imports()  # Bridge's training modules import without TE
        import torch
        import torch._dynamo
        from megatron.bridge.training import initialize, setup
        from megatron.core.optimizer import optimizer as core_optimizer

        def state():
            return {
                "synchronize": torch.cuda.synchronize, "empty_cache": torch.cuda.empty_cache,
                "dynamo": torch._dynamo.config.disable,
                "clip": core_optimizer.clip_grad_by_total_norm_fp32, "init": setup.initialize_megatron,
                "seed": initialize._set_random_seed,
            }

        before = state()
        with cpu_emulation.bridge_loop():
            inside = state()
            torch.cuda.synchronize()  # no CUDA here: a no-op inside
            on_cpu = torch.ones(1, device="cuda").device.type
        after = state()
        try:
            torch.ones(1, device="cuda")
            outside = "cpu"
        except (RuntimeError, AssertionError) as exc:
            outside = type(exc).__name__
        report(replaced=sorted(k for k in before if inside[k] is not before[k]),
               restored=sorted(k for k in before if after[k] is before[k]), on_cpu=on_cpu, outside=outside)
    """)
    assert result["replaced"] == ["clip", "dynamo", "empty_cache", "init", "seed", "synchronize"]
    assert result["restored"] == ["clip", "dynamo", "empty_cache", "init", "seed", "synchronize"]
    assert result["on_cpu"] == "cpu"
    assert result["outside"] != "cpu"  # the device mode is gone too


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulation is for machines without CUDA")
def test_the_all_to_all_dispatchers_split_sizes_reach_all_to_all_single_as_on_a_gpu():
    """Upstream's host copy leaves the dispatcher's split sizes torch tensors on a CPU rank, which
    ``all_to_all_single`` refuses; the stand-in gives the NumPy copy a GPU rank passes, and the exchange runs."""
    result = run("""
        from megatron_bridge_ext.testing import cpu_emulation

        cpu_emulation.install()
        import torch
        import torch.distributed as dist
        from megatron.core.transformer.moe import moe_utils, token_dispatcher

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        tokens = torch.arange(6.0).reshape(3, 2)
        splits = torch.tensor([3])  # tokens per rank, as the dispatcher computes them on the device

        def exchange(host_copy):
            out = torch.empty_like(tokens)
            sizes = host_copy(splits, as_numpy=True)
            try:
                dist.all_to_all_single(out, tokens, output_split_sizes=sizes, input_split_sizes=sizes)
            except TypeError:
                return "TypeError"
            return out.tolist()

        report(upstream=exchange(moe_utils.maybe_move_tensor_to_cpu),
               ours=exchange(token_dispatcher.maybe_move_tensor_to_cpu), tokens=tokens.tolist())
    """)
    assert result["upstream"] == "TypeError"
    assert result["ours"] == result["tokens"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulation is for machines without CUDA")
def test_the_moe_streams_run_in_order_on_the_cpu():
    """What the all-to-all dispatcher and overlapped shared experts do with streams and events works after
    install(), and fails without it (no CUDA)."""
    result = run("""
        import torch

        def use_streams():
            try:
                side = torch.cuda.Stream()
                on_side = torch.cuda.current_stream() != side
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    value = torch.ones(2).sum().item()
                side.record_event().synchronize()
                torch.cuda.current_stream().wait_stream(side)
                return [on_side, value]
            except (RuntimeError, AssertionError) as exc:  # torch.AcceleratorError is a RuntimeError
                return "raised " + type(exc).__name__

        before = use_streams()
        from megatron_bridge_ext.testing import cpu_emulation

        cpu_emulation.install()
        report(before=before, after=use_streams(), same=torch.cuda.current_stream() is torch.cuda.default_stream())
    """)
    assert str(result["before"]).startswith("raised ")
    assert result["after"] == [True, 2.0] and result["same"]
