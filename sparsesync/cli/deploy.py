"""`sparsesync deploy ...`: render and create the Spaces of a disaggregated run.

Each command renders a complete Docker Space folder locally, then (unless `--dry-run`) creates
or updates the Space through huggingface_hub, private by default, with the HF token only as a
Space secret.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="Deploy the environment and inference replicas as Hugging Face Spaces.", no_args_is_help=True)
