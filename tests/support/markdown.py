"""Reading the Markdown tables a report writes, by column title, so a test
checks the cells it means: a column added or moved leaves it passing, a wrong
figure fails it."""

from __future__ import annotations

import re


def table(markdown: str, below: str = "") -> dict[str, dict[str, str]]:
    """The first pipe table of ``markdown`` below the first line starting with
    ``below``: its rows by their first cell, each a dict column title -> cell."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(below))
    cells = []
    for line in lines[start:]:
        if line.startswith("|"):
            cells.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif cells:
            break
    assert len(cells) >= 2 and all(re.fullmatch(r":?-+:?", c) for c in cells[1]), f"no table below {below!r}"
    header, body = cells[0], cells[2:]
    assert all(len(row) == len(header) for row in body), "rows and header differ in width"
    rows = {row[0]: dict(zip(header, row)) for row in body}
    assert len(rows) == len(body), "two rows share their first cell"
    return rows


def cells(row: dict[str, str], *titles: str) -> dict[str, str]:
    """The cells of ``row`` under ``titles`` (a missing column fails)."""
    return {title: row[title] for title in titles}
