"""The consoles every command prints through: never a value cut short in piped output.

Rich lays tables out for 80 columns when stdout is not a terminal, cutting cells to `0.0…` or
`model.…`. `CliConsole` keeps the terminal's width in a terminal and, anywhere else (a pipe, a
file, a test runner), lays out on `PIPE_WIDTH` columns, so every value prints in full and
`sparsesync log URL | grep` sees what the run holds. Decided at each print: the same console
serves a terminal and a pipe alike.
"""

from __future__ import annotations

from rich.console import Console, ConsoleDimensions

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
