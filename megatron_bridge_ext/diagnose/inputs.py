"""What the user gives `mbx diagnose` -> (name, kind, stream) triples, recognised by content, never read whole.

Inputs are files, directories (every file below them, in name order) and ``-`` for standard input.
Each is opened as a binary stream; a gzip stream (magic ``1f 8b``) is decompressed on the fly. The
first bytes decide the kind:

* ``\\x80`` followed by a protocol byte 2-5: a pickle (a memory snapshot, :mod:`.snapshot`);
* ``{``, or ``[`` opening a JSON array (not ``[Rank 0]`` nor a launcher's ``[1,0]<stderr>:``), after white
  space: JSON (``torch.cuda.memory_stats()`` or an OOM report, :mod:`.classifier`);
* text without NUL bytes that decodes as UTF-8: a log (:mod:`.logs`); NUL bytes before the text are a log that
  was truncated in place while its writer went on (logrotate's ``copytruncate``), read as a log;
* anything else is refused, naming the file and what was expected.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import sys
from dataclasses import dataclass
from typing import BinaryIO, Iterator

PEEK = 4096
LOG, JSON, PICKLE = "log", "json", "pickle"
EXPECTED = ("expected a training log (text), a JSON of torch.cuda.memory_stats() or an OOM report, or a memory "
            "snapshot pickle, each optionally gzip-compressed")


class InputError(ValueError):
    """One line naming the input and what was expected."""


@dataclass
class Source:
    name: str
    kind: str
    stream: BinaryIO
    explicit: bool  # named on the command line (not found inside a directory)

    def text_lines(self) -> Iterator[str]:
        """The stream as text lines; undecodable bytes become U+FFFD rather than stopping the read."""
        return io.TextIOWrapper(self.stream, encoding="utf-8", errors="replace", newline="")


def expand(paths: list[str]) -> Iterator[tuple[str, bool]]:
    """Each path, or each file under a directory (sorted, hidden files skipped), with whether it was named."""
    for path in paths:
        if path == "-" or not os.path.isdir(path):
            yield path, True
            continue
        found = False
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if not name.startswith("."):
                    found = True
                    yield os.path.join(root, name), False
        if not found:
            raise InputError(f"{path}: the directory holds no file; {EXPECTED}")


def _open(path: str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file or directory") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory") from None
    except PermissionError:
        raise InputError(f"{path}: permission denied (cannot read it)") from None
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror or error})") from None


def open_source(path: str, explicit: bool = True) -> Source:
    """The input at ``path`` with its kind, positioned at its first byte (decompressed)."""
    name = "<stdin>" if path == "-" else path
    stream = io.BufferedReader(_open(path), PEEK) if path == "-" else _open(path)
    head = _peek(stream)
    if head[:2] == b"\x1f\x8b":
        stream = io.BufferedReader(gzip.GzipFile(fileobj=stream, mode="rb"), PEEK)
        try:
            head = _peek(stream)
        except (OSError, EOFError) as error:
            raise InputError(f"{name}: not a readable gzip stream ({error}); {EXPECTED}") from None
    if not head:
        raise InputError(f"{name}: empty; {EXPECTED}")
    return Source(name, _kind(name, head), stream, explicit)


_CONTROL = re.compile(rb"[\x01-\x07\x0e-\x1a\x1c-\x1f]")
"""Control bytes no text log holds (tab, newlines, form feed, backspace and the escape of colour codes excepted)."""


def _peek(stream: BinaryIO) -> bytes:
    """The first bytes without consuming them (every stream here is a buffered reader)."""
    return stream.peek(PEEK)[:PEEK]


def _opens_array(text: bytes) -> bool:
    after = text[1:].lstrip()[:1]
    return bool(after) and after in b'{["]-0123456789'


def _prefixed(head: bytes) -> bool:
    """The first line begins with a launcher's rank prefix (``[rank0]:``, ``[1,0]<stderr>:``): a log, not JSON."""
    from megatron_bridge_ext.diagnose.logs import strip_prefixes

    first = head.lstrip().split(b"\n", 1)[0].decode("utf-8", "replace")
    return strip_prefixes(first)[1] is not None


def _kind(name: str, head: bytes) -> str:
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return PICKLE
    text = head.lstrip()
    if text[:1] == b"{" or text[:1] == b"[" and _opens_array(text) \
            and not _prefixed(head):
        return JSON
    text_after_nul = head.lstrip(b"\x00")  # a log truncated in place (logrotate's copytruncate) starts with NULs
    if b"\x00" in text_after_nul or (len(text_after_nul) < len(head) and _CONTROL.search(text_after_nul)):
        raise InputError(f"{name}: binary data that is neither gzip nor a pickle; {EXPECTED}")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 4:  # a multi-byte character cut by the peek is fine
            raise InputError(f"{name}: bytes that are not UTF-8 text at offset {error.start}; {EXPECTED}") from None
    return LOG
