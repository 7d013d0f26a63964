"""PyTorch allocator option strings: parse, render, and which variable torch reads.

Pure Python, no torch import: the point is to act *before* torch reads the variables.

Grammar (the one torch's ``c10::CachingAllocator::ConfigTokenizer`` accepts): comma-separated
``key:value`` entries; a value is one token or a bracketed list, e.g.
``roundup_power2_divisions:[256:1,512:2,>:8]``. Torch drops all whitespace; a single trailing
comma is accepted; the last of duplicated keys wins (each entry overwrites the previous one).

Which variable torch reads (``PYTORCH_ALLOC_CONF`` vs the older ``PYTORCH_CUDA_ALLOC_CONF``)
changed across releases:

* torch >= 2.12 (checked on the installed 2.14.1): both the device-generic reader
  (``AcceleratorAllocatorConfig::instance()``, c10/core/AllocatorConfig.cpp) and the CUDA reader
  (``CUDAAllocatorConfig::instance()``, shipped header ``torch/include/c10/cuda/CUDAAllocatorConfig.h``)
  take the *first variable that is set* in the order ``PYTORCH_CUDA_ALLOC_CONF``,
  (``PYTORCH_HIP_ALLOC_CONF`` on ROCm), ``PYTORCH_ALLOC_CONF``, and ignore the rest. The order is
  visible in the header and in the string table of ``torch/lib/libc10.so``; running 2.14.1 with
  both set, ``torch._C._accelerator_getAllocatorSettings()`` returns the
  ``PYTORCH_CUDA_ALLOC_CONF`` value, and with ``PYTORCH_CUDA_ALLOC_CONF=""`` (set but empty) it
  returns ``""``: an empty ``PYTORCH_CUDA_ALLOC_CONF`` hides ``PYTORCH_ALLOC_CONF``.
  ``PYTORCH_ALLOC_CONF`` is the documented name (``torch.cuda.memory.get_allocator_backend``
  docstring) and is read when ``PYTORCH_CUDA_ALLOC_CONF`` is absent.
* 2.8 <= torch < 2.12: the generic reader took ``PYTORCH_ALLOC_CONF`` first and warned
  "PYTORCH_CUDA_ALLOC_CONF is deprecated" (upstream c10/core/AllocatorConfig.cpp of that period;
  pytorch/pytorch PR #167659 turned the old name back into a plain alias), yet 2.9.1 ignored
  ``PYTORCH_ALLOC_CONF`` for CUDA's ``expandable_segments`` and honoured only
  ``PYTORCH_CUDA_ALLOC_CONF`` (pytorch/pytorch issue #183387, fixed by 2.11). Not checked here on
  those releases, so in that range we make the variables agree: the option goes into every
  variable that is set, and into ``PYTORCH_CUDA_ALLOC_CONF`` when none is.
* torch < 2.8: only ``PYTORCH_CUDA_ALLOC_CONF`` exists.

Also from the installed 2.14.1: the allocator *backend* (``backend:cudaMallocAsync``) is fixed
when torch is imported (changing it afterwards fails with "Allocator backend parsed at runtime !=
allocator backend parsed at load time"); every other option is read lazily, on first use of
the allocator, so it can still be set after ``import torch`` as long as CUDA is untouched.
Unknown keys make 2.14.1 raise ``ValueError: Unrecognized key`` on first use; we keep them (the
user may target another torch) and report them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Union

CUDA_VAR = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_VAR = "PYTORCH_ALLOC_CONF"
VARIABLES = (CUDA_VAR, ALLOC_VAR)

# Keys the installed torch (2.14.1) recognises: the generic set in c10/core/AllocatorConfig.h and
# the CUDA set in c10/cuda/CUDAAllocatorConfig.h. Used only to warn, never to drop a key.
KNOWN_KEYS = frozenset({
    "backend", "expandable_segments", "expandable_segments_handle_type", "garbage_collection_threshold",
    "graph_capture_record_stream_reuse", "large_segment_size_mb", "max_non_split_rounding_mb",
    "max_split_size_mb", "per_process_memory_fraction", "pinned_free_catch_all", "pinned_max_cached_size_mb",
    "pinned_max_round_threshold_mb", "pinned_num_register_threads", "pinned_reserve_segment_size_mb",
    "pinned_use_background_threads", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "roundup_power2_divisions",
    "throw_on_cudamalloc_oom",
})
# Keys torch parses as a boolean: only the exact tokens True/False are accepted.
BOOLEAN_KEYS = frozenset({
    "expandable_segments", "graph_capture_record_stream_reuse", "pinned_free_catch_all",
    "pinned_use_background_threads", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "throw_on_cudamalloc_oom",
})

# Keys torch parses as a number (c10's ConfigTokenizer: toSizeT / stod). A non-number makes torch raise
# on first use of the allocator, i.e. after launch.
NUMBER_KEYS = frozenset({
    "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold", "large_segment_size_mb",
    "per_process_memory_fraction", "pinned_max_cached_size_mb", "pinned_max_round_threshold_mb",
    "pinned_num_register_threads", "pinned_reserve_segment_size_mb",
})
_NUMBER = re.compile(r"\d+(\.\d*)?\Z|\.\d+\Z")

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SEPARATORS = ",:[]"

Value = Union[str, tuple[str, ...]]


class AllocatorConfigError(ValueError):
    """A malformed allocator option string; the message names the variable and the bad token."""


@dataclass(frozen=True)
class Option:
    key: str
    value: Value  # one token, or the items of a bracketed list (e.g. ("256:1", ">:8"))

    def render(self) -> str:
        value = "[" + ",".join(self.value) + "]" if isinstance(self.value, tuple) else self.value
        return f"{self.key}:{value}"


@dataclass(frozen=True)
class AllocConf:
    """An ordered allocator option list; duplicates are kept (torch applies the last one)."""

    options: tuple[Option, ...] = ()

    @classmethod
    def parse(cls, text: Optional[str], variable: str = ALLOC_VAR) -> "AllocConf":
        return cls(tuple(_parse(text or "", variable)))

    def render(self) -> str:
        return ",".join(o.render() for o in self.options)

    def get(self, key: str) -> Optional[Value]:
        """The value torch applies for ``key``: the last occurrence, or None."""
        for option in reversed(self.options):
            if option.key == key:
                return option.value
        return None

    def __contains__(self, key: str) -> bool:
        return any(o.key == key for o in self.options)

    def keys(self) -> list[str]:
        return [o.key for o in self.options]

    def duplicates(self) -> list[str]:
        seen: set[str] = set()
        dups: list[str] = []
        for key in self.keys():
            if key in seen and key not in dups:
                dups.append(key)
            seen.add(key)
        return dups

    def unknown_keys(self) -> list[str]:
        return [k for k in dict.fromkeys(self.keys()) if k not in KNOWN_KEYS]

    def with_option(self, key: str, value: Value) -> "AllocConf":
        """Set ``key``: replace its last occurrence in place, or append it (order preserved)."""
        options = list(self.options)
        for i in range(len(options) - 1, -1, -1):
            if options[i].key == key:
                options[i] = Option(key, value)
                return AllocConf(tuple(options))
        return AllocConf((*options, Option(key, value)))

    def flag(self, key: str) -> Optional[bool]:
        """A boolean option as torch reads it: True, False, or None when absent."""
        value = self.get(key)
        return None if value is None else value == "True"


def _error(variable: str, text: str, token: str, problem: str, fix: str) -> AllocatorConfigError:
    return AllocatorConfigError(f"{variable}={text!r}: {problem} at {token!r}. Fix: {fix}")


def _split_entries(text: str, variable: str) -> list[str]:
    """Split on top-level commas; brackets may not nest and must balance."""
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise _error(variable, text, text[start:i + 1], "nested '['", "lists hold key:value items only")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _error(variable, text, text[start:i + 1], "']' without '['", "balance the brackets")
            depth = 0
        elif ch == "," and not depth:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise _error(variable, text, text[start:], "'[' never closed", "close the list with ']'")
    entries.append(text[start:])
    return entries


def _token(raw: str, variable: str, text: str, what: str, context: str) -> str:
    """One token; ``context`` (the entry or list it belongs to) is what an error shows when it is empty."""
    token = raw.strip()
    if not token:
        raise _error(variable, text, context.strip(), f"empty {what}", f"give the {what} or remove the entry")
    if any(c.isspace() for c in token):
        # torch deletes all whitespace, so 'expandable segments' would silently become 'expandablesegments'
        raise _error(variable, text, token, f"whitespace inside a {what}", "remove the space")
    if any(c in _SEPARATORS for c in token):
        raise _error(variable, text, token, f"unexpected separator in a {what}", "one ':' per entry, lists in [...]")
    return token


def _parse(text: str, variable: str) -> list[Option]:
    if not text.strip():
        return []
    pieces = _split_entries(text, variable)
    if len(pieces) > 1 and not pieces[-1].strip():
        pieces = pieces[:-1]  # torch accepts one trailing comma
    options = []
    for index, piece in enumerate(pieces):
        if not piece.strip():
            raise _error(variable, text, ",," if index else ",", "empty entry (two commas in a row or a leading "
                         "comma)", "remove the extra comma")
        key_raw, sep, value_raw = piece.partition(":")
        if not sep:
            raise _error(variable, text, piece.strip(), "missing ':' between key and value", "write key:value")
        key = _token(key_raw, variable, text, "key", piece)
        if not _KEY.match(key):
            raise _error(variable, text, key, "not a valid key", "keys are letters, digits and '_'")
        value_text = value_raw.strip()
        if value_text.startswith("["):
            if not value_text.endswith("]"):
                raise _error(variable, text, value_text, "text after the closing ']'", "end the entry at ']'")
            items = value_text[1:-1].split(",")
            value: Value = tuple(_list_item(item, variable, text, value_text) for item in items)
        else:
            value = _token(value_raw, variable, text, f"value for {key}", piece)
        if key in NUMBER_KEYS and not (isinstance(value, str) and _NUMBER.match(value)):
            raise _error(variable, text, f"{key}:{value}", "torch reads a number here",
                         f"write {key}:<number>, e.g. {key}:512" if key.endswith("_mb") else f"write {key}:<number>")
        if key in BOOLEAN_KEYS and value not in ("True", "False"):
            raise _error(variable, text, f"{key}:{value}", "torch accepts only True or False here",
                         f"write {key}:True or {key}:False (capitalised)")
        options.append(Option(key, value))
    return options


def _list_item(raw: str, variable: str, text: str, context: str) -> str:
    item = raw.strip()
    parts = item.split(":")
    if not item or len(parts) > 2 or not all(p.strip() for p in parts):
        raise _error(variable, text, item or context, "bad or empty list item",
                     "list items are 'a:b' (e.g. 256:1 or >:8)")
    return ":".join(_token(p, variable, text, "list item", context) for p in parts)


# --------------------------------------------------------------------------------------------
# Which variable torch reads
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precedence:
    """How one torch release reads the two variables."""

    read_order: tuple[str, ...]  # the first variable that is set (even to "") is parsed, the rest ignored
    default_target: str  # where to write when neither is set
    write_all_set: bool  # readers disagree in this release: keep every set variable in agreement
    note: str


def parse_version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"cannot read a torch version from {text!r}; expected e.g. '2.14.1'")
    return int(match.group(1)), int(match.group(2))


def precedence_for(torch_version: tuple[int, int]) -> Precedence:
    if torch_version >= (2, 12):
        return Precedence((CUDA_VAR, ALLOC_VAR), ALLOC_VAR, False,
                          f"{CUDA_VAR} if set (even empty), else {ALLOC_VAR}")
    if torch_version >= (2, 8):
        return Precedence((ALLOC_VAR, CUDA_VAR), CUDA_VAR, True,
                          f"{ALLOC_VAR} first (generic reader); 2.9.1 honours only {CUDA_VAR} for expandable_segments")
    return Precedence((CUDA_VAR,), CUDA_VAR, False, f"{CUDA_VAR} only")


def effective(environ: Mapping[str, str], torch_version: tuple[int, int]) -> tuple[Optional[str], AllocConf]:
    """The variable torch parses for the generic options, and its options (raises on malformed text)."""
    for name in precedence_for(torch_version).read_order:
        if name in environ:
            return name, AllocConf.parse(environ[name], name)
    return None, AllocConf()
