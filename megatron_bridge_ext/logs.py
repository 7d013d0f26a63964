"""Logging for our commands: our own decisions at INFO, upstream import chatter silenced."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings

# Messages upstream emits on every import on machines without Apex/TE; they say nothing about a run.
_IMPORT_NOISE = (
    r".*Apex is not installed.*",
    r".*Transformer Engine and Apex are not installed.*",
    r".*absl\.logging is not installed.*",
    r".*is deprecated\. Please use `torch\.distributed\..*",
    r".*set the environment variable CUDA_DEVICE_MAX_CONNECTIONS.*",
    r".*supports MoE experts, but your version is 0\.0\.0.*",
    r".*full scope is deprecated.*",
    r".*transformers>=5\.0 support is experimental.*",
    r".*If you are using transformer_engine as the transformer implementation.*",
    r".*`torch\.jit\.script` is deprecated.*",
)
_UPSTREAM = r"(megatron|torch|modelopt|transformers|apex)(\.|$)"
KNOWN_HARMLESS = (
    # Megatron Core's expert layers (tensor_parallel/layers.py) when the experts' TP is 1 under SP: expected
    r".*`sequence_parallel` is set to `True`, but tensor model parallel size is 1.*",
    # Megatron Core's TransformerConfig on a recipe's router dtype: advice for training, not for a plan
    r".*Using a large number of experts \(e\.g\. >=32\) without fp32 routing.*",
    # Megatron Core's TransformerConfig when a recipe sets the SM count under its older name (Bridge's Nemotron 3
    # recipes set moe_hybridep_num_sms): Core routes it to moe_flex_dispatcher_num_sms itself
    r".*_num_sms is deprecated\. Use moe_flex_dispatcher_num_sms instead.*",
    # Megatron Core's ModelParallelConfig on a recipe's cross_entropy_fusion_impl="te": advice for the training run
    # (Megatron-LM's argument validation), not for a plan of its memory
    r".*Transformer Engine cross entropy loss fusion has known stability issues.*",
    # Megatron Core's multimodal config, announced when Bridge's recipe modules import it
    r".*MimoModelConfig is experimental.*",
)
"""Upstream warnings on successful runs that are expected and say nothing about the run; ``--verbose`` shows them."""
KNOWN_HARMLESS_LOGGED = {
    # transformers' PretrainedConfig.torch_dtype property, getter and setter (configuration_utils.py L415, L425),
    # read by Bridge's HF model bridges on a recipe's config: the renaming is Bridge's to do, nothing for the run
    "transformers.configuration_utils": (r".*`torch_dtype` is deprecated! Use `dtype` instead!.*",),
    # Core's hybrid layer allocation on a pattern without '|' at PP > 1 (hybrid_layer_allocation.py L393-400): the
    # split it then makes is the one estimated; the plan meets it on every PP x 2 of a hybrid recipe it prices
    "megatron.core.models.hybrid.hybrid_layer_allocation": (
        r".*DEPRECATION: Using hybrid_layer_pattern without pipe \('\|'\) separators.*",),
}
"""Known harmless upstream lines that come through a logger, not ``warnings.warn``, by the logger that logs them
(a filter on that logger drops them; ``--verbose`` shows them)."""
QUIET_LOGGERS = ("torch.utils.cpp_extension",)
"""Loggers whose warnings are known noise: torch's "No CUDA runtime is found" on a machine without CUDA, once per
process (each demo rank)."""


class _KnownHarmless(logging.Filter):
    """Drops the records of one logger whose message matches one of its :data:`KNOWN_HARMLESS_LOGGED` patterns."""

    def __init__(self, patterns) -> None:
        super().__init__()
        self.patterns = [re.compile(p, re.S) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p.match(record.getMessage()) for p in self.patterns)


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class LogLevelError(ValueError):
    """``MBX_LOG_LEVEL`` names no logging level."""


def level_from_env() -> str:
    """``MBX_LOG_LEVEL`` (default INFO), or :class:`LogLevelError` naming the variable and the fix."""
    level = os.environ.get("MBX_LOG_LEVEL", "INFO").strip().upper()
    if level not in LEVELS:
        raise LogLevelError(f"MBX_LOG_LEVEL={os.environ['MBX_LOG_LEVEL']!r} is not a logging level. "
                            f"Fix: set it to one of {', '.join(LEVELS)}, or unset it")
    return level


def configure(*, verbose: bool = False) -> None:
    """INFO for ``megatron_bridge_ext`` (what was applied), WARNING for upstream (``MBX_LOG_LEVEL`` overrides);
    the :data:`KNOWN_HARMLESS` warnings and :data:`QUIET_LOGGERS` filtered unless ``verbose``.
    """
    level = level_from_env()
    if not verbose:
        for pattern in KNOWN_HARMLESS:
            warnings.filterwarnings("ignore", message=pattern)
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        for name, patterns in KNOWN_HARMLESS_LOGGED.items():
            logger = logging.getLogger(name)
            if not any(isinstance(f, _KnownHarmless) for f in logger.filters):
                logger.addFilter(_KnownHarmless(patterns))
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    # Ranks other than 0 repeat rank 0's decisions: they log warnings only.
    rank_level = level if os.environ.get("RANK", "0") == "0" else "WARNING"
    logging.getLogger("megatron_bridge_ext").setLevel(rank_level)
    for name in ("megatron", "megatron.bridge", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # The tiny model is a GPTModel on purpose (the class Bridge's GPT providers build).
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    # Bridge's import helper sets INFO on itself when imported and logs a traceback per missing TE
    # symbol; a filter on the logger object survives that (a level would be overwritten).
    import_logger = logging.getLogger("megatron.bridge.utils.import_utils")
    if level != "DEBUG" and not any(isinstance(f, _BelowWarning) for f in import_logger.filters):
        import_logger.addFilter(_BelowWarning())
    for pattern in _IMPORT_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    if os.environ.get("RANK", "0") != "0":  # other ranks would repeat rank 0's upstream warnings
        warnings.filterwarnings("ignore", module=_UPSTREAM)


@contextlib.contextmanager
def quiet_bridge_import():
    """Import Bridge inside this block without its import-time INFO on stdout.

    Bridge's modules import Megatron-LM's ``megatron.training`` (``megatron/bridge/utils/common_utils.py`` L29 ->
    ``megatron/training/__init__.py`` L14 -> ``training.py``), whose ``training.py`` L36 calls
    ``logging.basicConfig(handlers=[CustomHandler()], level=logging.INFO)``: the root logger at INFO with a
    handler that writes to stdout (``log_handler.py`` L16). The INFO records of the rest of the import (a
    traceback per Transformer Engine symbol Bridge's ``safe_import_from`` cannot import, ``utils/import_utils.py``
    L333, one announcement per model family) then land on a script's stdout before its own output. INFO is
    dropped while the block runs and the root's level is set back after it; warnings and errors pass, and the
    handler stays, for Bridge's training to log through once its ``setup_logging`` sets the level it wants.
    ``MBX_LOG_LEVEL=DEBUG`` leaves the import as it is.
    """
    if os.environ.get("MBX_LOG_LEVEL", "").strip().upper() == "DEBUG":
        yield
        return
    root = logging.getLogger()
    level, disabled = root.level, logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(disabled)
        root.setLevel(level)
