"""Megatron Bridge's training loop inside the functional test process, leaving the process as it was.

Bridge supports being called more than once in a process: ``pretrain`` only destroys a process
group it created itself (``should_destroy_process_group = not dist.is_initialized()``, Bridge
0.5.1 and 0.6.2 ``training/pretrain.py``), and ``_finish_train`` ends every run with
``destroy_global_state()`` (microbatch calculator, global memory buffer, Megatron Core's parallel
state, rerun state machine). So the runs share the test's process group and follow each other, with two exceptions that
``Session.next_run()`` handles, so that each run starts as in a fresh process: Bridge caches what it
reads from a checkpoint directory (``read_train_state`` and ``read_run_config`` in
``training/utils/checkpoint_utils.py`` are ``functools.lru_cache``d) and training then mutates the
cached ``TrainState``, so a second run resuming from the same checkpoint would start at the first
run's last iteration; and Bridge applies ``cfg.env_vars`` to ``os.environ``, which the next run's
``MemoryConfig`` would then find already set.

:func:`bridge_session` handles what a run leaves behind for the other tests: Megatron Core's parallel
state is destroyed before the runs (Bridge builds its own) and rebuilt with the same tensor-parallel
size afterwards; while it is held, the groups Bridge builds time out after ``MBX_DIST_TIMEOUT_S`` like
the test's own process group, whatever a run's ``cfg.dist.distributed_timeout_minutes`` says (a script
run as written, such as the docs' example, keeps Bridge's 10-minute default otherwise, so a rank left
waiting in a tensor-parallel collective would wait that long); the environment (Bridge applies
``cfg.env_vars``, ``megatron_bridge_ext.init()`` sets the allocator variables), logger levels and filters
(Bridge's setup drops WARNING records on every logger by default), warning filters and the RNG states are
restored. On a
machine without CUDA the runs go through the demo's CPU emulation of Bridge's loop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import warnings
from typing import Callable, Iterator

import numpy
import torch
import torch.distributed as dist


def _loggers() -> dict[str, logging.Logger]:
    return {"": logging.root, **{name: logger for name, logger in logging.root.manager.loggerDict.items()
                                 if isinstance(logger, logging.Logger)}}


def _logging_state() -> dict[str, tuple[int, list]]:
    """Each logger's level and filters (Bridge's ``setup_logging`` sets levels, and with ``filter_warnings``,
    its default, a filter that drops WARNING records on the root and on every logger that exists)."""
    return {name: (logger.level, list(logger.filters)) for name, logger in _loggers().items()}


def _restore_logging_state(state: dict[str, tuple[int, list]]) -> None:
    """Levels and filters as ``state`` has them; a logger created since gets NOTSET and loses the filters that
    were put on every logger (those on the root now and not before)."""
    added_everywhere = [f for f in logging.root.filters if f not in state[""][1]]
    for name, logger in _loggers().items():
        level, filters = state.get(name, (logging.NOTSET, [f for f in logger.filters if f not in added_everywhere]))
        logger.setLevel(level)
        logger.filters = list(filters)


def timeout_minutes() -> int:
    """The process group's timeout (``MBX_DIST_TIMEOUT_S``) in whole minutes, for Bridge's own groups."""
    return max(1, math.ceil(int(os.environ.get("MBX_DIST_TIMEOUT_S", "300")) / 60))


def _with_test_timeout(initialize: Callable) -> Callable:
    """Megatron Core's ``initialize_model_parallel`` building its groups with :func:`timeout_minutes`."""

    @functools.wraps(initialize)
    def initialize_model_parallel(*args, **kwargs):
        return initialize(*args, **dict(kwargs, distributed_timeout_minutes=timeout_minutes()))

    return initialize_model_parallel


class Session:
    """What :func:`bridge_session` yields."""

    def __init__(self, environ: dict[str, str]) -> None:
        self._environ = environ

    def next_run(self) -> None:
        """Call before each run: the environment as the session found it, Bridge's checkpoint caches empty."""
        from megatron.bridge.training.utils import checkpoint_utils

        from megatron_bridge_ext.testing import distributed

        distributed.destroy_model_parallel()  # what the last run left registered (Bridge destroys Core's state only)
        os.environ.clear()
        os.environ.update(self._environ)
        checkpoint_utils.read_train_state.cache_clear()
        checkpoint_utils.read_run_config.cache_clear()


@contextlib.contextmanager
def bridge_session() -> Iterator[Session]:
    """Hold around Bridge runs in this process; see the module docstring. Needs the process group initialised
    (:func:`shared_directory` does it)."""
    from megatron.core import parallel_state

    from megatron_bridge_ext.patches.registry import apply_training_entry
    from megatron_bridge_ext.testing import cpu_emulation, distributed

    tensor_parallel = None
    if parallel_state.model_parallel_is_initialized():
        tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    distributed.destroy_model_parallel()
    environ = dict(os.environ)
    logging_state = _logging_state()
    rng = (torch.get_rng_state(), random.getstate(), numpy.random.get_state())
    emulate = not torch.cuda.is_available()
    if emulate:
        cpu_emulation.bridge_imports()
    apply_training_entry()
    initialize = parallel_state.initialize_model_parallel
    parallel_state.initialize_model_parallel = _with_test_timeout(initialize)
    try:
        with warnings.catch_warnings(), (cpu_emulation.bridge_loop() if emulate else contextlib.nullcontext()):
            yield Session(environ)
    finally:
        parallel_state.initialize_model_parallel = initialize
        os.environ.clear()
        os.environ.update(environ)
        _restore_logging_state(logging_state)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        numpy.random.set_state(rng[2])
        distributed.destroy_model_parallel()  # a run that failed half-way, and the groups of the last run
        if tensor_parallel is not None:
            distributed.init_from_env(tensor_parallel=tensor_parallel)


def shared_directory(local: str) -> str:
    """Rank 0's ``local`` path, on every rank (the ranks of these tests share a file system).

    Initialises the process group first when no test has yet (Bridge then keeps it alive).
    """
    from megatron_bridge_ext.testing import distributed

    if not dist.is_initialized():
        dist.init_process_group(backend=distributed.backend_for_device(), timeout=distributed.DEFAULT_TIMEOUT)
    shared = [local if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
