"""Plain-text tables for the commands' output (demo, bench, patches)."""

from __future__ import annotations


def text_table(columns: list[str], rows: list[list[str]], *, right_aligned: bool = False, rule: bool = True) -> str:
    """Columns padded to their widest cell, two spaces apart; the last left-aligned column is not padded.

    ``right_aligned`` right-justifies every column but the first (figures); ``rule`` adds a dashed line
    under the header.
    """
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    last = len(columns) - 1

    def line(cells: list[str]) -> str:
        out = []
        for i, (cell, width) in enumerate(zip(cells, widths)):
            if right_aligned and i:
                out.append(cell.rjust(width))
            else:
                out.append(cell if i == last else cell.ljust(width))
        return "  ".join(out)

    header = [line(columns)] + ([line(["-" * w for w in widths])] if rule else [])
    return "\n".join(header + [line(r) for r in rows])
