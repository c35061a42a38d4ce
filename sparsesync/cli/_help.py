"""How every command's help reads: what `sparsesync CMD --help` shows a user.

`Command` is the Typer command class of every sub-command (`app.command(cls=Command)`), `Group`
that of the root and of `deploy`:
- the usage line names positional arguments as the help's text does (`push [OPTIONS] SOURCE
  URL`, not `{source} {url}`);
- a flag shows no value type (`--dry-run`, not `--dry-run <bool>`, which reads as if it took a
  value); flags are declared `--flag/--no-flag`;
- the docstring's paragraphs are reflowed, so the help wraps at the terminal's width instead
  of at the source's line breaks;
- the epilog (`exit_codes`) says what each exit status means.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

ERROR = "1 an error (one line on stderr: `error: ...` and `fix: ...`)"
USAGE = "2 a bad command line"


def exit_codes(*codes: str, ok: str = "0 done") -> str:
    """The epilog of a command: its exit statuses, `ok` first, then `codes`, an error, bad usage."""
    return "Exit status: " + "; ".join([ok, *codes, ERROR, USAGE]) + "."


def reflow(text: str) -> str:
    """`text` with each paragraph (blank-line separated) on one line."""
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", inspect.cleandoc(text)) if p.strip())


class _NoTypeOnFlags:
    """Mixin of `Command` and `Group`: their flags (and --help) show no value type."""

    params: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:
            _no_type(p)

    def get_help_option(self, ctx: Any) -> Any:
        opt = super().get_help_option(ctx)  # type: ignore[misc]  # a mixin: the click class after it in the MRO has it
        if opt is not None:
            _no_type(opt)
        return opt


class Command(_NoTypeOnFlags, TyperCommand):
    """A Typer command whose help reads as the module docstring says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.help:
            self.help = reflow(self.help)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if isinstance(p, TyperArgument):
                name = (p.metavar or p.name or "").upper()
                pieces.append(name if p.required else f"[{name}]")
        return pieces


class Group(_NoTypeOnFlags, TyperGroup):
    """A Typer group (the root, `deploy`) whose own flags show no value type either."""


def _no_type(p: Any) -> None:
    if isinstance(p, TyperOption) and p.is_flag and p.metavar is None:
        p.metavar = ""  # a flag takes no value: no type shown
