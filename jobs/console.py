"""Terminal output of the CLI: lines within WIDTH columns and tables. (What Ray, Ray Data and
transformers print of their own is kept out in pipelines/ray/quiet.py.)
"""

from __future__ import annotations

import textwrap

WIDTH = 100  # every line the CLI prints fits this many columns (paths excepted)


def wrap(text: str) -> str:
    """Lines longer than WIDTH wrapped, continuation lines indented."""
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  ") if len(line) > WIDTH else line
                     for line in text.splitlines())


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain right-aligned table of `rows` (dicts); columns are (header, key, format), e.g.
    ("reward", "reward/mean", "{:.3f}"). Columns no row has are left out; a missing value is '-';
    columns that would pass WIDTH are left out from the right."""
    columns = [c for c in columns if any(r.get(c[1]) is not None for r in rows)]
    cells = [[_cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
    widths = [max(len(header), *(len(row[i]) for row in cells)) for i, (header, _, _) in enumerate(columns)]
    keep, used = 0, -2
    while keep < len(columns) and used + 2 + widths[keep] <= WIDTH:
        used += 2 + widths[keep]
        keep += 1
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(columns[:keep], widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row[:keep], widths)) for row in cells]
    return "\n".join(lines)


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if fmt.endswith("d}"):
        value = int(value)
    return fmt.format(value)
