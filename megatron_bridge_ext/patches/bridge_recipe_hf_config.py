"""A Bridge model recipe's Hugging Face config read, answered from a local ``config.json`` or failed fast.

Bridge's model recipes (``megatron.bridge.recipes.qwen.qwen3:qwen3_8b_peft_config`` and most others)
build their model with ``AutoBridge.from_hf_pretrained(model_id, revision=...)``, which reads the
model's ``config.json`` from the hub through ``safe_load_config_with_retry``: up to 4 calls of
``transformers.AutoConfig.from_pretrained``, each retried by ``huggingface_hub`` with backoff. A
machine without the hub waits minutes for that error; a few recipes call ``AutoConfig.from_pretrained``
themselves. Nothing else of the recipe touches the hub when it builds the provider without weights.

While :func:`answering` is active (``mbx plan --recipe`` runs the recipe function inside it):

* with a local config, every ``AutoConfig.from_pretrained`` of a hub id returns that config (as
  ``AutoConfig.for_model`` builds it from the JSON), so the recipe runs offline on the model the
  user names;
* without one, a hub read first checks that the hub answers (``HF_HUB_OFFLINE`` set, or no TCP
  connection to its endpoint within a few seconds, means it does not); when it does not, the read
  uses the local cache only, and ``safe_load_config_with_retry`` makes one attempt instead of four.

A recipe that reads the model's tokenizer from the hub (``AutoTokenizer.from_pretrained``: Bridge's Gemma 2 and 3
fine-tuning recipes, to grow the vocabulary to the tokenizer's length) gets, with a local config, a
:class:`TokenizerLength` of that config's ``vocab_size``, and without one and without the hub an ``OSError`` at once.

Outside the block the wrappers call upstream unchanged. A local directory path is never redirected.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlparse

from megatron_bridge_ext.patches.base import Patch

AUTO_BRIDGE = "megatron.bridge.models.conversion.auto_bridge"
CONNECT_TIMEOUT_S = 3.0


@dataclass
class HubRead:
    """What happened to the recipe's hub reads inside :func:`answering`."""

    local: Any = None
    requested: Optional[str] = None
    """The first hub id the recipe asked for (None: it read no Hugging Face config)."""
    unreachable: Optional[str] = None
    """Why the hub was taken as unreachable (None: reachable, or not checked)."""
    checked: bool = False
    tokenizer: Optional[str] = None
    """The hub id of a tokenizer the recipe read, answered by :class:`TokenizerLength` from the local config."""


class TokenizerLength:
    """What a planner can say of a hub tokenizer without its files: its length, taken as the local config.json's
    ``vocab_size`` (the embedding rows of the model it belongs to). Bridge's Gemma recipes read a tokenizer only to
    grow ``model.vocab_size`` to ``len(tokenizer)`` (``recipes/gemma/h100/gemma2.py`` L300-306, ``gemma3.py``
    L153-158), so this answer leaves the model's vocabulary as config.json states it."""

    def __init__(self, name: str, vocab_size: int):
        self.name_or_path, self.vocab_size = name, vocab_size

    def __len__(self) -> int:
        return self.vocab_size


_ACTIVE: list[HubRead] = []


def _hub_unreachable() -> Optional[str]:
    """Why the hub cannot answer, in a few seconds at most; None when it can."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        return f"no connection to {host}:{port}: {error}"
    return None


def _is_hub_id(path) -> bool:
    return not os.path.isdir(os.fspath(path))


def _state_for(path) -> Optional[HubRead]:
    """The active read state when ``path`` is a hub id, with the hub checked once; None to call upstream."""
    if not _ACTIVE or not _is_hub_id(path):
        return None
    state = _ACTIVE[-1]
    state.requested = state.requested or str(path)
    if state.local is None and not state.checked:
        state.unreachable, state.checked = _hub_unreachable(), True
    return state


def _wrap_from_pretrained(original) -> Callable:
    def from_pretrained(cls, path, *args, **kwargs):
        state = _state_for(path)
        if state is not None and state.local is not None:
            return copy.deepcopy(state.local)  # each read its own, as from the hub
        if state is not None and state.unreachable:
            kwargs["local_files_only"] = True
        return original(cls, path, *args, **kwargs)

    return classmethod(from_pretrained)


def _vocab_size(config) -> Optional[int]:
    """A transformers config's vocabulary, its text model's where a multimodal config nests it."""
    return getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)


def _wrap_tokenizer(original) -> Callable:
    """A hub tokenizer read inside :func:`answering`: the local config's length (:class:`TokenizerLength`), or, with
    no local config and no hub, an ``OSError`` at once instead of the hub client's retries."""
    def from_pretrained(cls, path, *args, **kwargs):
        state = _state_for(path)
        vocab = _vocab_size(state.local) if state is not None else None
        if vocab:
            state.tokenizer = str(path)
            return TokenizerLength(str(path), vocab)
        if state is not None and state.unreachable:
            raise OSError(f"the tokenizer of {path} is on the Hugging Face hub, which is not reachable "
                          f"({state.unreachable})")
        return original(cls, path, *args, **kwargs)

    return classmethod(from_pretrained)


def _wrap_safe_load(original) -> Callable:
    def safe_load_config_with_retry(path, *args, **kwargs):
        state = _state_for(path)
        if state is not None and state.unreachable:
            kwargs["max_retries"] = 0
        return original(path, *args, **kwargs)

    return safe_load_config_with_retry


def _needed() -> tuple[bool, str]:
    return True, ("Bridge's model recipes read their config.json from the Hugging Face hub when called "
                  "(AutoBridge.from_hf_pretrained -> safe_load_config_with_retry -> AutoConfig.from_pretrained), "
                  "with retries that take minutes offline")


def _apply() -> Callable[[], None]:
    from transformers import AutoConfig, AutoTokenizer

    original = AutoConfig.__dict__["from_pretrained"]
    AutoConfig.from_pretrained = _wrap_from_pretrained(original.__func__)
    tokenizer = AutoTokenizer.__dict__["from_pretrained"]
    AutoTokenizer.from_pretrained = _wrap_tokenizer(tokenizer.__func__)
    auto_bridge = sys.modules.get(AUTO_BRIDGE)
    safe_load = getattr(auto_bridge, "safe_load_config_with_retry", None)
    if safe_load is not None:
        auto_bridge.safe_load_config_with_retry = _wrap_safe_load(safe_load)

    def undo() -> None:
        AutoConfig.from_pretrained = original
        AutoTokenizer.from_pretrained = tokenizer
        if safe_load is not None:
            auto_bridge.safe_load_config_with_retry = safe_load

    return undo


PATCH = Patch(
    name="bridge_recipe_hf_config",
    target="transformers.AutoConfig.from_pretrained, transformers.AutoTokenizer.from_pretrained, and "
           f"{AUTO_BRIDGE}.safe_load_config_with_retry (AutoBridge.from_hf_pretrained's config read)",
    distribution="megatron-bridge",
    versions=">=0.5.1,<=0.6.2",
    reason="Bridge's model recipes read their Hugging Face config from the hub, retrying for minutes when it is "
           "unreachable; a planner given the model's config.json needs neither",
    applied_by="mbx plan --recipe, while the recipe function runs (megatron_bridge_ext.estimate.configs), and "
               "reverted after it",
    needed=_needed,
    do_apply=_apply,
)


@contextlib.contextmanager
def answering(local_config=None) -> Iterator[HubRead]:
    """Run a recipe with its hub config read answered by ``local_config`` (a transformers config), or failing
    fast when the hub is unreachable; yields what the recipe asked for. Applies the patch for the block only
    (unless it was applied already)."""
    state = HubRead(local=local_config)
    applied_here = not PATCH.applied
    PATCH.apply(quiet=True)
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.remove(state)
        if applied_here:
            PATCH.revert()
