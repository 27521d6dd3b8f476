"""Laying out what the commands print for a terminal of any width (80 columns and up):
tables whose columns all stay (fixed ones as wide as their longest cell, flexible ones
sharing the rest and cut with "…" only when they must), runs of `name value` facts
packed onto lines without splitting a fact, and plain lines wrapped between words.
Piped output is not padded: `cli_support.rich_console` trims what rich pads lines with."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

#: Spaces between two table columns.
GAP = 2


@dataclass
class Col:
    header: str
    justify: str = "left"
    flex: bool = False  # shares the room the fixed columns leave; cut with "…" when it must
    min_width: int = 0  # a flexible column is never made narrower (unless its cells are)


def column_widths(cols: list[Col], rows: list[tuple[str, ...]], width: int) -> list[int]:
    """Each column's width: fixed ones their longest cell (or header); flexible ones share
    what is left, each at least its min_width, none wider than its longest cell. At a
    width too small for the minimums the table is wider than `width`, never missing a column."""
    natural = [max([len(c.header)] + [max(map(len, str(r[i]).split("\n"))) for r in rows]) for i, c in enumerate(cols)]
    widths = [n if not c.flex else min(n, max(c.min_width, len(c.header))) for n, c in zip(natural, cols)]
    room = width - GAP * (len(cols) - 1) - sum(widths)
    growing = [i for i, c in enumerate(cols) if c.flex and widths[i] < natural[i]]
    while room > 0 and growing:  # share the room evenly; a column that is whole stops growing
        share = max(1, room // len(growing))
        for i in list(growing):
            add = min(share, natural[i] - widths[i], room)
            widths[i] += add
            room -= add
            if widths[i] == natural[i]:
                growing.remove(i)
            if room == 0:
                break
    return widths


def fitted_table(cols: list[Col], rows: list[tuple[str, ...]], widths: list[int], title: str | None = None,
                 show_header: bool = True):
    """A rich Table of `rows` with these column widths: no padding at its edges, cells
    that do not fit cut with "…" (a cell may hold lines of its own, split at "\\n")."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, padding=(0, GAP // 2), pad_edge=False, header_style="bold", title=title,
                  title_justify="left", title_style="bold", show_header=show_header)
    for c, w in zip(cols, widths):
        table.add_column(c.header, justify=c.justify, width=w, no_wrap=True, overflow="ellipsis")
    for r in rows:
        table.add_row(*(cell if not isinstance(cell, str) else Text(cell) for cell in r))
    return table


class FittedTable:
    """A table laid out for the width it is drawn at (a terminal resized under `--watch`
    or `rollout up` included)."""

    def __init__(self, cols: list[Col], rows: list[tuple], title: str | None = None, row_styles=None,
                 show_header: bool = True):
        self.cols, self.rows, self.title, self.row_styles = cols, rows, title, row_styles or [None] * len(rows)
        self.show_header = show_header

    def __rich_console__(self, console, options):
        from rich.text import Text

        plain = [tuple(str(c) for c in r) for r in self.rows]
        widths = column_widths(self.cols if self.show_header else [Col("", c.justify, c.flex, c.min_width)
                                                                   for c in self.cols], plain, options.max_width)
        styled = [tuple(Text(c, style=s or "") for c in r) for r, s in zip(plain, self.row_styles)]
        yield fitted_table(self.cols, styled, widths, self.title, self.show_header)


def packed(items: list[str], width: int, sep: str = "   ") -> list[str]:
    """`items` joined by `sep` onto as few lines of at most `width` as they fit on; an item
    is never split (one longer than `width` has a line of its own)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + len(sep) + len(item) <= width:
            lines[-1] += sep + item
        else:
            lines.append(item)
    return lines


class Facts:
    """Labelled runs of facts (`queue  prompts 6   in flight 0 ...`): the labels in a
    column, each run packed onto lines as wide as the console, no fact split."""

    def __init__(self, rows: list[tuple[str, list[str]]]):
        self.rows = rows

    def __rich_console__(self, console, options):
        from rich.text import Text

        label_w = max((len(label) for label, _ in self.rows), default=0)
        room = max(20, options.max_width - label_w - GAP)
        for label, items in self.rows:
            lines = [part for line in packed(items, room)
                     for part in textwrap.wrap(line, room, break_on_hyphens=False, break_long_words=False)]
            for n, line in enumerate(lines):
                out = Text((label if n == 0 else "").ljust(label_w + GAP), style="bold")
                out.append(line)
                yield out


class Hanging:
    """A line wrapped between words at the console's width, continuation lines indented."""

    def __init__(self, line: str, indent: int = 2, style: str | None = None):
        self.line, self.indent, self.style = line, indent, style

    def __rich_console__(self, console, options):
        from rich.text import Text

        yield Text(wrapped(self.line, options.max_width, self.indent), style=self.style or "")


def wrapped(line: str, width: int, indent: int = 0) -> str:
    """A plain line wrapped between words at `width` (a flag such as --input-key or an id
    is never split), continuation lines indented by `indent`."""
    if len(line) <= width:
        return line
    return textwrap.fill(line, width, subsequent_indent=" " * indent, break_long_words=False,
                         break_on_hyphens=False)
