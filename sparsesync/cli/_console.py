"""The consoles every command prints through: never a value cut short in piped output.

Rich lays tables out for 80 columns when stdout is not a terminal, cutting cells to `0.0…` or
`model.…`. `CliConsole` keeps the terminal's width in a terminal and, anywhere else (a pipe, a
file, a test runner), lays out on `PIPE_WIDTH` columns, so every value prints in full and
`sparsesync log URL | grep` sees what the run holds. Decided at each print: the same console
serves a terminal and a pipe alike. `print_table` prints a table's title on its own line and,
outside a terminal, its rows without trailing spaces.
"""

from __future__ import annotations

from rich.console import Console, ConsoleDimensions
from rich.table import Table

PIPE_WIDTH = 1 << 14  # wider than any row we print: tables take their natural width


class CliConsole(Console):
    """A rich `Console` (no highlighting) that does not cut output that is not a terminal."""

    def __init__(self, *, stderr: bool = False) -> None:
        super().__init__(highlight=False, stderr=stderr)

    @property
    def size(self) -> ConsoleDimensions:
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(PIPE_WIDTH, super().size.height)
        return super().size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size

    def print_table(self, table: Table, title: str | None = None) -> None:
        """`title` (markup) on a line of its own, never wrapped into the table's width (a long
        URL stays whole), then `table`; outside a terminal without trailing spaces or blank
        padding lines, so a file or a pipe gets only the rows."""
        if title:
            self.print(title, soft_wrap=True)
        if self.is_terminal:
            self.print(table)
            return
        with self.capture() as cap:
            self.print(table)
        lines = [line.rstrip() for line in cap.get().splitlines()]
        while lines and not lines[0]:
            lines.pop(0)
        while lines and not lines[-1]:
            lines.pop()
        self.print("\n".join(lines), markup=False, emoji=False, soft_wrap=True)
