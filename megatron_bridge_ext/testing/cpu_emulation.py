"""CPU emulation of the CUDA-only calls Megatron Core and Megatron Bridge make on the paths we run.

Used only by the CPU runs of the demo and benchmarks (:mod:`.cpu_run`) and by the tests, when
CUDA is absent, so that 2-rank gloo runs can execute real Megatron Core tensor/sequence-parallel
layers, and Megatron Bridge's own ``pretrain``/``finetune`` loop, on a CPU machine. No feature of
the package imports it. Everything it changes is listed here.

:func:`install` (Megatron Core's TP/SP layers; before ``megatron.core.tensor_parallel`` is imported):

* ``torch.cuda.current_device`` -> ``"cpu"``: Megatron Core allocates gather/reduce-scatter
  outputs and its ``GlobalMemoryBuffer`` on ``torch.cuda.current_device()``.
* the CUDA RNG state calls used by ``CudaRNGStatesTracker`` and activation checkpointing
  (``torch.cuda.get_rng_state``/``manual_seed`` and Megatron Core's ``_get_cuda_rng_state``/
  ``_set_cuda_rng_state``) -> CPU generator states, so that ``model_parallel_cuda_manual_seed``
  and recompute work and stay deterministic.
* ``get_default_causal_mask`` (built with ``device="cuda"``) -> the same mask on the CPU, in
  ``megatron.core.transformer.utils`` and in ``megatron.core.fusions.fused_softmax`` that imports it.
* a CPU stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` (wgrad GEMM accumulated into
  ``main_grad``), so that ``gradient_accumulation_fusion=True`` can be exercised. It must be
  installed before ``megatron.core.tensor_parallel.layers`` is imported.
* CUDA streams and events -> :class:`megatron_bridge_ext.estimate.routing.InOrderStream` (work on the CPU is already in order):
  ``torch.cuda.Stream``/``Event``/``current_stream``/``stream``. Megatron Core's MoE all-to-all token
  dispatcher makes one at construction (``transformer/moe/token_dispatcher.py:469``) and copies its
  split sizes to the host on it (``:922-925``, event ``:946``, synchronised ``:951``); shared experts
  with ``moe_shared_expert_overlap`` run on one of their own (``transformer/moe/shared_experts.py:98,192,
  226,237,260,321,335,354,362``, ``transformer/moe/moe_layer.py:595``).
* the all-to-all dispatcher's host copy of its split sizes (``token_dispatcher.py:927-944`` call
  ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``) -> :func:`_host_copy`. Upstream copies
  only CUDA tensors (``moe_utils.py:1184``): on a CPU rank the splits would stay torch tensors, and
  ``torch.distributed.all_to_all_single`` (``tensor_parallel/mappings.py:460``) refuses them on any
  backend (its ``ProcessGroup`` binding takes a sequence of ints; the NumPy array a GPU rank passes is one).

The MoE line numbers are Core 0.19.2's; Core 0.18.2 has the same calls at token_dispatcher.py:451,902-926,
shared_experts.py:92-355, moe_layer.py:586, moe_utils.py:1127 and mappings.py:456.

:func:`bridge_imports` (once, before Bridge's training modules are imported), then
:func:`bridge_loop` (a context manager held around ``pretrain``/``finetune``, which restores
everything on exit) add what Bridge's loop needs. Line numbers: Bridge 0.6.2 / Core 0.19.2
(Bridge 0.5.1 / Core 0.18.2 have the same calls at other lines):

* imports: Bridge's PEFT modules through ``bridge_peft_without_te``; the training-entry patches
  (``bridge_pretrain_without_nvrx``, ``bridge_prebuilt_dataset_helpers``); on Bridge 0.5.1,
  ``recipes/__init__.py:22`` reaches ``diffusion/models/wan/utils.py:20``
  ``import transformer_engine_torch`` (used only in a THD helper), which gets a placeholder for that
  one import when TE is absent, so that the recipes import.
* hard-coded CUDA devices -> CPU, one ``TorchFunctionMode`` (:class:`CudaToCpu`): ``device="cuda"``
  factories (``training/setup.py:281``, ``data/loaders.py:406``, ``initialize.py:895-944``,
  ``utils/train_utils.py:769,1210``, ``core/pipeline_parallel/schedules.py:749``,
  ``core/optimizer/optimizer.py:315,1249``, ``clip_grads.py:108,112``, ``core/utils.py:1332``,
  ``checkpointing.py:326``, ``train.py:1461``, ``eval.py:295,313``), ``Tensor.cuda()``
  (``models/model_provider.py:689``, ``gpt_step.py:266``, ``utils/batch_utils.py:54-58``) and
  ``Tensor.to("cuda")``. A mode sees the calls of its own thread only: keep
  ``checkpoint.async_save=False`` and ``dataset.num_workers=0``.
* ``torch.cuda`` runtime calls with no CPU meaning -> no-ops: ``synchronize`` (``core/timers.py:152,165``,
  ``train.py:1030``, ``dist_checkpointing/strategies/filesystem_async.py:248``), ``empty_cache``
  (``initialize.py:955``, ``train.py:934,973,1329``, ``checkpointing.py:3199``, ``optim.py:241``),
  ``set_device``, the ``memory_*`` statistics (``utils/train_utils.py:1280``); the loop's streams/events
  (``megatron/training/models/dist_utils.py:303-306,366``, ``core/distributed/param_and_grad_buffer.py:632``)
  are :func:`install`'s stand-ins.
* ``core/optimizer/clip_grads.py:174`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``:
  ``clip_grad_by_total_norm_fp32`` is replaced, in ``core/optimizer/optimizer.py``'s namespace
  (imported by name at :52, called at :410,420,1906,1916), by the same scaling without the device assert.
* ``initialize.py:89-91`` asserts CUDA unless ``allow_no_cuda=True``, which ``setup.py:253`` does not
  pass; ``initialize.py:761-763`` refuses NCCL without devices: Bridge's ``initialize_megatron``
  runs with ``allow_no_cuda=True`` and the gloo backend.
* ``initialize.py:869`` seeds Megatron Core's tensor-parallel RNG tracker only when
  ``torch.cuda.device_count() > 0`` (without it the model build fails with "model-parallel-rng is not
  added"): ``_set_random_seed`` runs with the CPU counted as the one device, so upstream's own
  seeding runs.
* Megatron Core's ``jit_fuser`` is ``torch.compile`` (``core/jit.py``): TorchDynamo is disabled, so the
  fused functions run eagerly instead of compiling C++ on the CPU ranks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_bridge_ext.estimate.routing import InOrderStream

_INSTALLED = False
_BRIDGE_IMPORTS_READY = False


def _wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input, computed in main_grad's dtype (as the CUDA kernel)."""
    main_grad.add_(grad_output.to(main_grad.dtype).t().matmul(total_input.to(main_grad.dtype)))


def _fake_fused_wgrad_module() -> types.ModuleType:
    module = types.ModuleType("fused_weight_gradient_mlp_cuda")
    module.__doc__ = "CPU stand-in installed by megatron_bridge_ext.testing.cpu_emulation"
    module.wgrad_gemm_accum_fp32 = _wgrad_gemm_accum
    module.wgrad_gemm_accum_fp16 = _wgrad_gemm_accum
    return module


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` with the CPU as the device: every tensor gets the host copy (a
    NumPy array when ``as_numpy``) that upstream makes of a CUDA tensor; ``record_stream`` concerns only
    the CUDA caching allocator."""
    if not torch.is_tensor(tensor):
        return tensor
    host = tensor.detach().to("cpu", copy=True)
    return host.numpy() if as_numpy else host


def _install_cuda_streams() -> None:
    """Streams and events with no CUDA: token_dispatcher.py:469,922-951; shared_experts.py:98-362; moe_layer.py:595."""
    torch.cuda.Stream = InOrderStream
    torch.cuda.Event = InOrderStream
    torch.cuda.current_stream = _returns(_CPU_STREAM)
    torch.cuda.default_stream = _returns(_CPU_STREAM)
    torch.cuda.stream = _returns(contextlib.nullcontext)


def install() -> bool:
    """Install the CPU redirections when CUDA is absent. Returns True when installed."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    if "megatron.core.tensor_parallel.layers" in sys.modules and "fused_weight_gradient_mlp_cuda" not in sys.modules:
        raise RuntimeError(
            "megatron_bridge_ext.testing.cpu_emulation.install() must run before megatron.core.tensor_parallel is imported"
        )
    sys.modules.setdefault("fused_weight_gradient_mlp_cuda", _fake_fused_wgrad_module())

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it; the CPU generator is already seeded

    _install_cuda_streams()
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    def cpu_causal_mask(sq: int) -> torch.Tensor:
        """A fresh mask per call, as Megatron Core's (0.19) builds one per call and layer."""
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    transformer_utils.get_default_causal_mask = cpu_causal_mask
    fused_softmax.get_default_causal_mask = cpu_causal_mask
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    _INSTALLED = True
    return True


# ------------------------------------------------------------------------------------------------
# Megatron Bridge's training loop
# ------------------------------------------------------------------------------------------------

_WAN_UTILS = "megatron.bridge.diffusion.models.wan.utils"  # Bridge 0.5.1 only


def bridge_imports() -> None:
    """Make Bridge's training modules and recipes importable without CUDA-only packages (idempotent).

    Call after :func:`install` and before importing ``megatron.bridge``.
    """
    global _BRIDGE_IMPORTS_READY
    if _BRIDGE_IMPORTS_READY:
        return
    from megatron_bridge_ext.patches import bridge_peft_without_te, import_hooks
    from megatron_bridge_ext.patches.registry import apply_training_entry

    # Bridge 0.5.1 recipes/__init__.py:22 -> diffusion/models/wan/utils.py:20 `import transformer_engine_torch`
    if importlib.util.find_spec("transformer_engine_torch") is None and _WAN_UTILS not in sys.modules:
        placeholder = bridge_peft_without_te.te_placeholder()
        import_hooks.scoped_imports([_WAN_UTILS], lambda name, fromlist: placeholder
                                    if name == "transformer_engine_torch" else None)
    bridge_peft_without_te.import_bridge_peft()  # megatron/bridge/__init__.py reaches peft/lora_layers.py
    apply_training_entry()
    _BRIDGE_IMPORTS_READY = True


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class CudaToCpu(TorchFunctionMode):
    """Every torch call of this thread that names a CUDA device gets the CPU; ``Tensor.cuda()`` moves to the CPU.

    Covers ``device="cuda"`` (training/setup.py:281, data/loaders.py:406, initialize.py:895-944,
    utils/train_utils.py:769,1210, core/pipeline_parallel/schedules.py:749, core/optimizer/optimizer.py:315,1249,
    core/optimizer/clip_grads.py:108,112, core/utils.py:1332, checkpointing.py:326, train.py:1461,
    eval.py:295,313) and ``.cuda()`` (models/model_provider.py:689, gpt_step.py:266, utils/batch_utils.py:54-58).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to("cpu", non_blocking=kwargs.get("non_blocking", False))
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _returns(value):
    return lambda *args, **kwargs: value() if callable(value) else value


_CPU_STREAM = InOrderStream()
"""The one stream of a CPU rank: ``torch.cuda.current_stream()`` and ``default_stream()`` return it."""


def _cuda_runtime_stand_ins() -> dict:
    """``torch.cuda`` calls with no CPU meaning: synchronize (core/timers.py:152,165, train.py:1030,
    dist_checkpointing/strategies/filesystem_async.py:248), empty_cache (initialize.py:955, train.py:934,973,1329,
    checkpointing.py:3199, optim.py:241), memory_stats (utils/train_utils.py:1280), set_stream. The streams
    (megatron/training/models/dist_utils.py:303-306,366, core/distributed/param_and_grad_buffer.py:632) are
    :func:`install`'s."""
    stand_ins = {name: _returns(None) for name in (
        "synchronize", "empty_cache", "set_device", "set_stream", "reset_peak_memory_stats")}
    stand_ins.update({name: _returns(0) for name in (
        "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")})
    stand_ins.update(memory_stats=_returns(dict))
    return stand_ins


def _clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """Megatron Core's gradient clipping (same coefficient, grads scaled in place) without its CUDA-type assert
    (core/optimizer/clip_grads.py:174; called from core/optimizer/optimizer.py:410,420,1906,1916)."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [to_local_if_dtensor(getattr(p, attribute)).detach() for p in parameters
             if getattr(p, attribute, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff = clip_coeff.clamp_max(1.0)
    elif clip_coeff >= 1.0:
        return
    if grads:
        torch._foreach_mul_(grads, clip_coeff)


def _initialize_on_cpu(original):
    """initialize.py:89-91 asserts CUDA unless allow_no_cuda (setup.py:253 passes none); :761-763 refuse NCCL."""

    def initialize_megatron(cfg, *args, allow_no_cuda=False, **kwargs):
        cfg.dist.distributed_backend = "gloo"
        return original(cfg, *args, allow_no_cuda=True, **kwargs)

    return initialize_megatron


def _seed_with_the_cpu_as_device(original):
    """initialize.py:869 seeds the tensor-parallel RNG tracker only when torch.cuda.device_count() > 0."""

    def set_random_seed(*args, **kwargs):
        device_count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.device_count = device_count

    return set_random_seed


@contextlib.contextmanager
def _replaced(replacements: list[tuple[object, str, object]]) -> Iterator[None]:
    """Set each ``(owner, name, value)`` and put the old values back on exit."""
    old = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    try:
        for owner, name, value in replacements:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(old):
            setattr(owner, name, value)


@contextlib.contextmanager
def bridge_loop() -> Iterator[None]:
    """Hold around Bridge's ``pretrain``/``finetune`` on CPU ranks; everything is restored on exit.

    Needs :func:`install` first; runs :func:`bridge_imports` (it imports Bridge's training modules).
    """
    if not _INSTALLED:
        raise RuntimeError("megatron_bridge_ext.testing.cpu_emulation.install() must run first (and CUDA be absent)")
    bridge_imports()
    import torch._dynamo
    from megatron.bridge.training import initialize, setup
    from megatron.core.optimizer import optimizer as core_optimizer

    replacements = [(torch.cuda, name, value) for name, value in _cuda_runtime_stand_ins().items()]
    replacements += [
        (core_optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm),
        (setup, "initialize_megatron", _initialize_on_cpu(setup.initialize_megatron)),
        (initialize, "_set_random_seed", _seed_with_the_cpu_as_device(initialize._set_random_seed)),
        (torch._dynamo.config, "disable", True),  # core/jit.py: jit_fuser = torch.compile
    ]
    with _replaced(replacements), CudaToCpu():
        yield
