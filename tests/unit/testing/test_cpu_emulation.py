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
    # mbx demo / bench start CPU ranks through the runner; the GPU check's peak-memory part installs it for its
    # --dry-run on a CPU (the CPU rehearsal); no feature imports it
    assert importers == ["device_check/peak_memory.py", "testing/cpu_run.py"]


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
                "synchronize": torch.cuda.synchronize, "Stream": torch.cuda.Stream, "dynamo": torch._dynamo.config.disable,
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
    assert result["replaced"] == ["Stream", "clip", "dynamo", "init", "seed", "synchronize"]
    assert result["restored"] == ["Stream", "clip", "dynamo", "init", "seed", "synchronize"]
    assert result["on_cpu"] == "cpu"
    assert result["outside"] != "cpu"  # the device mode is gone too
