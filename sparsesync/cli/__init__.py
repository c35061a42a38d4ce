"""The `sparsesync` command: a thin Typer app over the library.

The root only wires sub-commands; each command is a few lines over a library call and
imports torch and friends lazily, so `sparsesync --help` stays fast. Errors are formatted in
one place (`_errors.py`).
"""

from __future__ import annotations

import typer

from sparsesync.cli import demo, deploy, follow, run_info, weights
from sparsesync.cli._errors import run_guarded
from sparsesync.cli.status import status

app = typer.Typer(
    help="Ship RL weight updates as sparse, digest-checked safetensors patches through a bucket.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(weights.push)
app.command()(weights.pull)
app.command()(run_info.log)
app.command()(run_info.inspect)
app.command()(run_info.verify)
app.command()(run_info.gc)
app.command()(demo.demo)
app.command()(follow.follow)
app.command()(status)
app.add_typer(deploy.app, name="deploy")


def main() -> None:
    """Console-script entry point."""
    run_guarded(app)
