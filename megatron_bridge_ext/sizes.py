"""Memory sizes as users write them, one parser for every size option of ``mbx``.

Both unit families are common and they differ by 7% at the gigabyte: GB = 10^9 bytes (what
Bridge and most papers print), GiB = 2^30 bytes (what ``nvidia-smi`` and torch's allocator
print). A bare number is refused rather than read as bytes: ``--gpu-memory 40`` read as 40 bytes
sends the planner through every lever for a minute before it says nothing fits. GPUs are sold
by a rounded binary figure: one sold as "80GB" holds about 80 GiB (an H100 80GB reports
81,559 MiB), which is 85.5 GB, not 80 GB; :func:`sold_as_note` says so where a GB figure meets one.
"""

from __future__ import annotations

import re
from typing import Optional

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40

UNITS = {"B": 1, "KB": KB, "MB": MB, "GB": GB, "TB": TB, "KiB": KIB, "MiB": MIB, "GiB": GIB, "TiB": TIB}
"""Accepted units, matched without regard to case (``80gib`` is 80 GiB)."""
_BY_LOWER = {name.lower(): factor for name, factor in UNITS.items()}
_SIZE = re.compile(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-zA-Z]*)\s*")  # signed: a negative is named as such


SOLD_AS = "an A100 40GB reports 40,536 MiB, an H100 80GB 81,559 MiB"
"""What two GPUs sold by a GB figure report (``nvidia-smi``, ``torch.cuda.get_device_properties``)."""


class SizeError(ValueError):
    """A size that cannot be read: the text is one line naming the option and the fix."""


def parse_size(text: str, option: str) -> int:
    """Bytes of ``text`` (``40GB``, ``37.25 GiB``, ``81559MiB``, ``512B``); ``option`` names it in errors.

    Raises :class:`SizeError` for a bare number, an unknown unit or a size that is not positive.
    """
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise SizeError(f"{option}: {text!r} is not a size. Fix: write a number and a unit, e.g. 80GiB or 80GB")
    number, unit = match.groups()
    if not unit:
        raise SizeError(f"{option}: {number} has no unit. Fix: write {number}GiB or {number}GB")
    factor = _BY_LOWER.get(unit.lower())
    if factor is None:
        raise SizeError(f"{option}: {unit!r} in {text!r} is not a unit. Fix: use one of {', '.join(UNITS)}, "
                        f"e.g. {number}GiB or {number}GB")
    size = int(float(number) * factor)
    if size <= 0:
        raise SizeError(f"{option}: {text!r} is not a positive size. Fix: give the device's memory, e.g. 80GiB")
    return size


def gib_figure(nbytes: Optional[float], *, grouped: bool = False, signed: bool = False) -> str:
    """Bytes as a number of GiB with two decimals and no unit, as a column headed in GiB shows it (``5.59``;
    ``-`` when unknown); ``grouped`` separates the thousands (``1,024.00``), ``signed`` prints the sign
    (``+1.12``). ``mbx plan``'s and ``mbx diagnose``'s GiB figures are this function's, :func:`gib`'s included."""
    if nbytes is None:
        return "-"
    return f"{nbytes / GIB:{'+' if signed else ''}{',' if grouped else ''}.2f}"


def gib(nbytes: float) -> str:
    """Bytes in GiB, the one unit of ``mbx`` output (``33.53 GiB``)."""
    return f"{gib_figure(nbytes, grouped=True)} GiB"


def whole_gb(nbytes: int) -> int | None:
    """The number of GB when ``nbytes`` is a whole number of GB (how ``80GB`` reads), else None."""
    return nbytes // GB if nbytes % GB == 0 else None


def sold_as_note(nbytes: int, option: str) -> str | None:
    """A note when a size given in whole GB looks like a GPU's sales figure, which counts GiB; else None."""
    gb = whole_gb(nbytes)
    if gb is None:
        return None
    return (f"{option} {gb}GB is {gib(nbytes)} (GB = 10^9 bytes); a GPU sold as \"{gb}GB\" holds about "
            f"{gb} GiB ({SOLD_AS}): for such a GPU give {option} {gb}GiB")
