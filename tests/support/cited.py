"""Whether a finding cites the upstream line that refuses: the line is found by running the upstream code and reading
where its error was raised, never from the finding's own text."""

from __future__ import annotations

import os
import re
import traceback


def raised_at(call, *errors: type) -> tuple[str, int]:
    """The file name and line of the innermost frame of the error ``call()`` raises (it must raise one of
    ``errors``)."""
    try:
        call()
    except errors as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return os.path.basename(frame.filename), frame.lineno
    raise AssertionError(f"{call} raised none of {errors}")


def cites(message: str, file: str, line: int) -> bool:
    """``message`` names ``file`` followed by line ranges (``L150-152``, ``L2076-2080 / L2089-2096``, ``L310``) one
    of which holds ``line``."""
    found = re.search(rf"{re.escape(file)} ((?:L\d+(?:-\d+)?(?: / |, )?)+)", message)
    if not found:
        return False
    for lo, hi in re.findall(r"L(\d+)(?:-(\d+))?", found.group(1)):
        if int(lo) <= line <= int(hi or lo):
            return True
    return False
