"""The upstream warnings ``logs.configure`` filters as known and harmless: filtered by default, shown with
``verbose``, and each pattern matching the text upstream really emits."""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

import pytest

from megatron_bridge_ext import logs

pytestmark = [pytest.mark.unit]

SP_WITH_TP_1 = "`sequence_parallel` is set to `True`, but tensor model parallel size is 1. Disabling sequence parallel."
"""Megatron Core 0.19 ``tensor_parallel/layers.py`` (ColumnParallelLinear.__init__), as the MoE example printed it."""


def _core_source(relative: str) -> str:
    import megatron.core

    return (Path(megatron.core.__file__).parent / relative).read_text()


@pytest.mark.parametrize("verbose, shown", [(False, []), (True, [SP_WITH_TP_1])])
def test_a_known_harmless_warning_is_filtered_unless_verbose(verbose, shown):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logs.configure(verbose=verbose)
        warnings.warn(SP_WITH_TP_1, UserWarning)
        warnings.warn("a warning nobody listed", UserWarning)
    assert [str(w.message) for w in caught] == [*shown, "a warning nobody listed"]


def test_the_patterns_match_what_megatron_core_emits():
    """The filtered texts are upstream's own: each pattern matches the message of the Core file that warns it
    (its adjacent string literals joined, as Python joins them; ``{world_size}`` is 1 on the expert layers, and the
    deprecated SM-count names are the one Bridge's Nemotron 3 recipes set)."""
    fields = {"{world_size}": "1", "{', '.join(_deprecated_num_sms)}": "moe_hybridep_num_sms"}
    sources = [("tensor_parallel/layers.py", logs.KNOWN_HARMLESS[0]),
               ("transformer/transformer_config.py", logs.KNOWN_HARMLESS[1]),
               ("transformer/transformer_config.py", logs.KNOWN_HARMLESS[2]),
               ("model_parallel_config.py", logs.KNOWN_HARMLESS[3]),
               ("models/mimo/config/base_configs.py", logs.KNOWN_HARMLESS[4])]
    assert len(sources) == len(logs.KNOWN_HARMLESS)  # every filtered pattern is checked against its source
    for relative, pattern in sources:
        joined = re.sub(r"\"\s*\n\s*f?\"", "", _core_source(relative))
        for field, value in fields.items():
            joined = joined.replace(field, value)
        assert any(re.match(pattern, line.strip().lstrip("f").strip("\"")) for line in joined.splitlines()), pattern


@pytest.mark.parametrize("verbose, enabled", [(False, False), (True, True)])
def test_torchs_no_cuda_runtime_logger_is_quiet_unless_verbose(verbose, enabled):
    logger = logging.getLogger(logs.QUIET_LOGGERS[0])
    saved = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        logs.configure(verbose=verbose)
        assert logger.isEnabledFor(logging.WARNING) is enabled
    finally:
        logger.setLevel(saved)


def _bridge_source(relative: str) -> str:
    from importlib.util import find_spec

    return (Path(find_spec("megatron.bridge").submodule_search_locations[0]) / relative).read_text()


@pytest.mark.parametrize("log_level, info_shown", [("INFO", False), ("DEBUG", True)])
def test_bridges_import_helper_info_tracebacks_are_dropped_unless_debug(monkeypatch, log_level, info_shown):
    """Bridge's ``safe_import_from`` logs, at INFO with a traceback, each Transformer Engine symbol it cannot
    import (``FP8GlobalStateManager`` among them, imported by ``peft/utils.py``) on a logger it sets to INFO with
    its own handler; ``configure`` drops those records on that logger (a level would be overwritten) unless
    ``MBX_LOG_LEVEL=DEBUG``, and keeps its warnings."""
    source = _bridge_source("utils/import_utils.py")
    assert "logger = logging.getLogger(__name__)" in source and "logger.setLevel(logging.INFO)" in source
    assert '"FP8GlobalStateManager"' in _bridge_source("peft/utils.py")
    name = "megatron.bridge.utils.import_utils"
    logger = logging.getLogger(name)
    saved = list(logger.filters)
    monkeypatch.setenv("MBX_LOG_LEVEL", log_level)
    try:
        logger.filters = []
        logs.configure()
        record = lambda level: logger.makeRecord(name, level, __file__, 1, "could not import FP8GlobalStateManager",
                                                 None, None)
        assert (bool(logger.filter(record(logging.INFO))), bool(logger.filter(record(logging.WARNING)))) == (
            info_shown, True)
    finally:
        logger.filters = saved


def test_importing_our_lora_leaves_no_bridge_info_on_stdout_and_keeps_warnings():
    """Bridge's import chain runs Megatron-LM's ``training.py``, whose ``logging.basicConfig`` puts the root logger
    at INFO with a stdout handler; a script importing our LoRA must not then print Bridge's import-time INFO (the
    tracebacks of ``safe_import_from``) before its own output, nor later INFO of Bridge's loggers, while a
    warning still reaches the handler Bridge installed."""
    import subprocess
    import sys

    from importlib.util import find_spec

    training = Path(find_spec("megatron.training").submodule_search_locations[0]) / "training.py"
    assert "logging.basicConfig(handlers=[CustomHandler()], level=logging.INFO)" in training.read_text()
    code = ("import logging\n"
            "from megatron_bridge_ext.peft import LoRA\n"
            "log = logging.getLogger('megatron.bridge.probe')\n"
            "log.info('INFO-PROBE')\n"
            "log.warning('WARNING-PROBE')\n")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "MBX_LOG_LEVEL"}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("INFO")] == []
    assert "Traceback" not in done.stdout
    assert "WARNING-PROBE" in done.stdout


def _transformers_source(relative: str) -> str:
    import transformers

    return (Path(transformers.__file__).parent / relative).read_text()


def test_the_logged_patterns_match_what_transformers_logs():
    """Each logged pattern matches the message of a ``logger.warning_once`` line of the file that logs it."""
    for name, patterns in logs.KNOWN_HARMLESS_LOGGED.items():
        if not name.startswith("transformers."):
            continue
        relative = name.removeprefix("transformers.").replace(".", "/") + ".py"
        lines = [line.strip() for line in _transformers_source(relative).splitlines() if "logger.warning" in line]
        messages = [line.split("(", 1)[1].rsplit(")", 1)[0].strip("\"") for line in lines]
        for pattern in patterns:
            assert any(re.match(pattern, m) for m in messages), pattern


def test_the_hybrid_pattern_line_matches_what_megatron_core_logs():
    """Core logs it as one message of adjacent string literals (hybrid_layer_allocation.py L393-400)."""
    import importlib.util

    name = "megatron.core.models.hybrid.hybrid_layer_allocation"
    source = Path(importlib.util.find_spec(name).origin).read_text()
    start = source.index('"DEPRECATION: Using hybrid_layer_pattern')
    message = "".join(re.findall(r'"([^"]*)"', source[start:source.index(")", source.index("Example", start))]))
    [pattern] = logs.KNOWN_HARMLESS_LOGGED[name]
    assert re.match(pattern, message), message


@pytest.mark.parametrize("verbose, shown", [(False, False), (True, True)])
def test_transformers_torch_dtype_line_is_dropped_unless_verbose(verbose, shown):
    """The line comes through transformers' logger (its own handler prints it), so a warnings filter misses it."""
    name = "transformers.configuration_utils"
    logger = logging.getLogger(name)
    saved = list(logger.filters)
    try:
        logger.filters = []
        logs.configure(verbose=verbose)
        record = logger.makeRecord(name, logging.WARNING, __file__, 1, "`torch_dtype` is deprecated! Use `dtype` "
                                   "instead!", None, None)
        other = logger.makeRecord(name, logging.WARNING, __file__, 1, "a line nobody listed", None, None)
        assert (bool(logger.filter(record)), bool(logger.filter(other))) == (shown, True)
    finally:
        logger.filters = saved
