"""Tables for people, laid out as `docker images` and `git log --oneline` are: no borders, one
row per item, and an identifier is never broken across lines.

Column widths are decided here, not by rich: rich would fold a 64-character key over four
lines to fit 80 columns. A column whose cells are single words (keys, names, numbers, paths)
never wraps; a column of prose wraps between words, never narrower than its longest word, so a
key quoted in a reason stays whole too. When even that is too wide, columns marked `optional`
are left out (last first; --json has every field), then a `trim` column is cut from the left
("…lama-3.2-1B"), where names differ least. A table that cannot fit still keeps every word
whole and lets the terminal wrap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

GAP = 2  # spaces between columns
ELLIPSIS = "…"


@dataclass(frozen=True)
class Col:
    header: str
    optional: bool = False  # left out when the table would not fit otherwise
    trim: int = 0  # if > 0: may be cut from the left, down to this many characters


def plain(cell: Any) -> str:
    """A cell's text as it will show (rich markup such as [green]ok[/green] taken out)."""
    return Text.from_markup(str(cell)).plain


def _longest_word(text: str) -> int:
    return max((len(w) for w in text.split()), default=0)


def _natural(cells: list[str]) -> int:
    return max((len(line) for c in cells for line in c.splitlines() or [""]), default=0)


def _is_prose(cells: list[str]) -> bool:
    """Sentences wrap; a value of one or two words ("100 B", "not installed") stays on a line."""
    return any(len(c.split()) > 2 for c in cells)


def fit(columns: Sequence[Col], rows: Sequence[Sequence[Any]], width: int) -> list[int | None]:
    """The width of each column (None: left out) so the table fits `width` if it can."""
    texts = [[plain(r[i]) for r in rows] + [col.header] for i, col in enumerate(columns)]
    natural = [_natural(t) for t in texts]
    floors = []
    for col, cells, nat in zip(columns, texts, natural, strict=True):
        if col.trim:
            floors.append(min(nat, max(col.trim, len(col.header))))
        elif _is_prose(cells):
            floors.append(max(_longest_word(c) for c in cells))
        else:
            floors.append(nat)
    shown = list(range(len(columns)))

    def narrowed(trim: bool) -> dict[int, int]:
        """Narrow the widest column that may shrink, a step at a time, until the table fits."""
        widths = {i: natural[i] for i in shown}
        while sum(widths.values()) + GAP * (len(shown) - 1) > width:
            room = [i for i in shown if widths[i] > floors[i] and (trim or not columns[i].trim)]
            if not room:
                break
            widths[max(room, key=lambda i: widths[i])] -= 1
        return widths

    while True:
        widths = narrowed(trim=False)
        optional = [i for i in shown if columns[i].optional]
        if sum(widths.values()) + GAP * (len(shown) - 1) <= width:
            break
        if not optional:  # names are cut only when no column is left to leave out
            widths = narrowed(trim=True)
            break
        shown.remove(optional[-1])
    return [widths.get(i) for i in range(len(columns))]


def trim_left(text: str, width: int) -> str:
    return text if len(text) <= width else ELLIPSIS + text[len(text) - width + 1 :]


def lay_out(
    columns: Sequence[Col], rows: Sequence[Sequence[Any]], width: int
) -> tuple[Table, int]:
    """The table and the width it takes (more than `width` only when it cannot fit)."""
    widths = fit(columns, rows, width)
    keep = [i for i, w in enumerate(widths) if w is not None]
    table = Table(box=None, pad_edge=False, padding=(0, GAP // 2), header_style="bold")
    for i in keep:
        prose = _is_prose([plain(r[i]) for r in rows])
        table.add_column(
            columns[i].header.upper(), width=widths[i], no_wrap=not prose, overflow="fold"
        )
    for row in rows:
        cells: list[str | Text] = []
        for i in keep:
            if columns[i].trim:
                cells.append(Text(trim_left(plain(row[i]), widths[i] or 0)))
            else:
                cells.append(str(row[i]))
        table.add_row(*cells)
    return table, sum(widths[i] or 0 for i in keep) + GAP * (len(keep) - 1)


def print_rows(
    console: Console, columns: Sequence[Col], rows: Sequence[Sequence[Any]], budget: int
) -> None:
    """The table laid out for `budget` columns (the terminal's width, or unbounded where
    lines are not wrapped: then each cell is one line)."""
    table, width = lay_out(columns, rows, budget)
    # Wider than the terminal only when it cannot fit: then the terminal wraps, no key is cut.
    options = console.options.update_width(max(width, min(budget, console.width)))
    segments: list[Segment] = []
    for line in console.render_lines(table, options, pad=False):
        segments += _rstrip(line) + [Segment.line()]
    console.print(Segments(segments), crop=False, soft_wrap=True, end="")


def _rstrip(line: list[Segment]) -> list[Segment]:
    """Cells are padded to their column; a line ends at its last character, as docker's do."""
    line = list(line)
    while line and not line[-1].text.strip():
        line.pop()
    if line:
        last = line[-1]
        line[-1] = Segment(last.text.rstrip(), last.style, last.control)
    return line
