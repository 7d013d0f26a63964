"""How ``mbx plan`` ends when something fails that no check foresaw, and what it says while it imports.

Every input is checked before the build (:mod:`.plan_inputs`) and the build and the estimate refuse
what they cannot model (:class:`~megatron_bridge_ext.findings.Refused`). An error of any other kind
inside Bridge's build or the fake parallel world is no user mistake, but a traceback of upstream frames
tells the user nothing: it ends in one line with its type and message, and ``--debug`` shows the
traceback.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from megatron_bridge_ext.findings import Refused, joined

UNEXPECTED_STATUS = 1
"""Exit status of a plan stopped by an unexpected error (bad input exits 2)."""
IMPORTING = "importing Megatron Bridge and building the config ..."


class Unexpected(Exception):
    """An error no check foresaw, as the one line ``mbx plan`` prints."""


@contextlib.contextmanager
def unexpected(debug: bool) -> Iterator[None]:
    """Turn any error but a refusal into :class:`Unexpected`; ``debug``: let it through with its traceback."""
    try:
        yield
    except Refused:
        raise
    except Exception as error:  # noqa: BLE001  (whatever upstream raises: its type and message are the report)
        if debug:
            raise
        text = str(error).strip().splitlines()
        raise Unexpected(joined(f"the plan failed: {type(error).__name__}: {text[0] if text else '(no message)'}",
                                "rerun with --debug for the traceback (no input check caught this: please "
                                "report it with the command)")) from None


def say_importing(stream=None) -> None:
    """One line before the slow imports, on a terminal only (a pipe or a log keeps just the plan)."""
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        print(f"mbx plan: {IMPORTING}", file=stream, flush=True)
