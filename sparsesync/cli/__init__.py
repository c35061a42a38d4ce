"""The `sparsesync` command: a thin Typer app over the library.

The root only wires sub-commands; each command is a few lines over a library call and
imports torch and friends lazily, so `sparsesync --help` stays fast. Errors are formatted in
one place (`_errors.py`); how help reads (usage names, flags, wrapping, exit statuses) in
`_help.py`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from sparsesync.cli import demo, deploy, follow, run_info, weights
from sparsesync.cli._errors import run_guarded
from sparsesync.cli._help import Command, Group, exit_codes
from sparsesync.cli.status import EXIT_UNHEALTHY, status

app = typer.Typer(
    help="Ship RL weight updates as sparse, digest-checked safetensors patches through a bucket.",
    no_args_is_help=True,
    cls=Group,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from sparsesync import __version__

        typer.echo(f"sparsesync {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print sparsesync's version and exit.", is_eager=True,
                                          callback=_print_version)] = False,
) -> None:
    """Ship RL weight updates as sparse, digest-checked safetensors patches through a bucket."""


app.command(cls=Command, epilog=exit_codes(ok="0 pushed (or the run's newest version already holds these weights)"))(
    weights.push
)
app.command(cls=Command, epilog=exit_codes(ok="0 pulled"))(weights.pull)
app.command(cls=Command, epilog=exit_codes(ok="0 listed"))(run_info.log)
app.command(cls=Command, epilog=exit_codes(ok="0 shown"))(run_info.inspect)
app.command(cls=Command, epilog=exit_codes("1 also when a version does not verify (its line says FAILED)",
                                           ok="0 every version verified"))(run_info.verify)
app.command(cls=Command, epilog=exit_codes(ok="0 deleted (or, with --dry-run, listed)"))(run_info.gc)
app.command(
    cls=Command,
    epilog=exit_codes(
        "1 also when a check failed (the report says which)", "130 interrupted by Ctrl-C", ok="0 every check passed"
    ),
)(demo.demo)
app.command(cls=Command, epilog=exit_codes(ok="0 stopped by --until-version or Ctrl-C"))(follow.follow)
app.command(cls=Command, epilog=exit_codes(
    f"{EXIT_UNHEALTHY} the fleet is not healthy (fewer than --min-replicas live replicas, one more than --max-lag "
    "behind or serving an abandoned version, or one degraded)", ok="0 the fleet is healthy"))(status)
app.add_typer(deploy.app, name="deploy")


def main() -> None:
    """Console-script entry point."""
    run_guarded(app)
