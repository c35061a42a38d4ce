"""`sparsesync deploy ...`: render and create the Spaces of a disaggregated run.

Each command renders a complete Docker Space folder locally, then (unless `--dry-run`) creates
or updates the Space through huggingface_hub, private by default, with credentials only as Space
secrets (the HF token, a bucket URL carrying credentials, the server's API key) and shown
redacted. A public Space always gets an API key: `--api-key`, or a generated one that is saved
(mode 600) under ~/.config/sparsesync/api-keys/ and shown masked, never printed whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sparsesync.cli._help import Command, Group, exit_codes

ApiKey = Annotated[
    Optional[str],
    typer.Option(
        help="Key clients must send as `Authorization: Bearer KEY` (a Space secret). Default: generated for a --public "
             "Space, none for a private one.",
        envvar="SPARSESYNC_DEPLOY_API_KEY",
        show_envvar=True,
    ),
]


def _api_key(space: str, given: str | None, public: bool, dry_run: bool, secret_name: str) -> str | None:
    """The key to set as a secret; a generated one is saved to a private file and shown masked."""
    from sparsesync.deploy.space import mask, resolve_api_key, save_api_key

    key, generated = resolve_api_key(given, public)
    if generated and dry_run:
        typer.echo(f"a public Space: a generated API key would be set as the secret {secret_name}")
    elif generated and key is not None:
        path = save_api_key(space, key)
        typer.echo(f"a public Space: generated API key {mask(key)} set as the secret {secret_name}; "
                   f"read it from {path} (mode 600); clients send Authorization: Bearer <key>")
    return key


app = typer.Typer(
    help="Deploy the environment and inference replicas as Hugging Face Spaces.", no_args_is_help=True, cls=Group
)


def _placeholder() -> str:
    """A stand-in secret value for a dry run's plan (never sent, shown only as "value hidden")."""
    import secrets

    return f"dry-run-{secrets.token_hex(8)}"


def _rendered(folder: Path, out: Path | None) -> str:
    return f"rendered {folder}" if out is not None else \
        f"rendered into {folder} (a new temporary folder, kept; --out DIR renders into a folder of your choice)"


@app.command("env", cls=Command, epilog=exit_codes(ok="0 deployed (or, with --dry-run, rendered and planned)"))
def env(
    space: Annotated[str, typer.Option(help="The Space to create or update, NAMESPACE/NAME.")],
    hardware: Annotated[str, typer.Option(help="Space hardware flavor (cpu-basic, cpu-upgrade, ...).")] = "cpu-basic",
    public: Annotated[
        bool, typer.Option("--public/--private", help="Make the Space public (default: private).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run/--no-dry-run", help="Render the folder and print the plan; no network.")
    ] = False,
    out: Annotated[Optional[Path], typer.Option(help="Render into this (empty or new) folder.")] = None,
    task: Annotated[str, typer.Option(help="Default task of the server: wordle or repeat.")] = "wordle",
    max_sessions: Annotated[int, typer.Option(help="Concurrent live sessions at most.")] = 256,
    idle_timeout: Annotated[float, typer.Option(help="Seconds before an idle session is evicted.")] = 300.0,
    region: Annotated[Optional[str], typer.Option(help="Hub region of the Space: us or eu.")] = None,
    api_key: ApiKey = None,
) -> None:
    """Render the environment-server Space (env_space/) and create or update it on the Hub."""
    import tempfile

    from sparsesync.deploy.env import env_space_spec
    from sparsesync.deploy.space import apply, plan, render, shell_env

    key = _api_key(space, api_key, public, dry_run, "ENV_API_KEY")
    spec = env_space_spec(space, hardware=hardware, private=not public, region=region, task=task,
                          max_sessions=max_sessions, idle_timeout_s=idle_timeout, api_key=key)
    folder = render(spec, out if out is not None else Path(tempfile.mkdtemp(prefix="sparsesync-env-space-")))
    the_plan = plan(spec, folder)
    typer.echo(_rendered(folder, out))
    typer.echo(the_plan.describe())
    if dry_run:
        import shlex

        env_vars = " ".join(shell_env(spec, skip=()))
        typer.echo(
            f"dry run: nothing sent. Boot it locally: cd {shlex.quote(str(folder))} && {env_vars} python -m env_space"
        )
        return
    url = apply(the_plan)
    typer.echo(f"deployed {url}")


@app.command("inference", cls=Command, epilog=exit_codes(ok="0 deployed (or, with --dry-run, rendered and planned)"))
def inference(
    space: Annotated[
        str, typer.Option(help="The Space to create or update, NAMESPACE/NAME (NAME-1..K with --replicas K).")
    ],
    bucket: Annotated[str, typer.Option(help="Run URL the replicas follow: hf://buckets/NS/NAME/PREFIX or s3://...")],
    model: Annotated[
        str, typer.Option(help="Initial weights: a local model folder (copied into the Space) or a Hub model id.")
    ],
    engine: Annotated[str, typer.Option(help="Inference engine: vllm or embedded.")] = "vllm",
    hardware: Annotated[
        Optional[str], typer.Option(help="Space hardware flavor (default l4x1 for vllm, cpu-upgrade for embedded).")
    ] = None,
    region: Annotated[
        Optional[list[str]], typer.Option(help="Hub region (us or eu); repeat to spread replicas round-robin.")
    ] = None,
    replicas: Annotated[int, typer.Option(help="Number of replica Spaces.")] = 1,
    poll_interval: Annotated[float, typer.Option(help="Seconds between checks for new versions.")] = 1.0,
    public: Annotated[
        bool, typer.Option("--public/--private", help="Make the Spaces public (default: private).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run/--no-dry-run", help="Render the folders and print the plans; no network.")
    ] = False,
    out: Annotated[
        Optional[Path],
        typer.Option(help="Render into this (empty or new) folder (one sub-folder per replica when K > 1)."),
    ] = None,
    api_key: ApiKey = None,
    s3_credentials: Annotated[
        bool,
        typer.Option(
            "--s3-credentials/--no-s3-credentials",
            help="For an s3:// bucket: send this shell's AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                 "AWS_SESSION_TOKEN, "
            "AWS_ENDPOINT_URL, AWS_REGION, AWS_DEFAULT_REGION when set) to the Spaces as secrets; never written to a "
            "file or shown.",
        ),
    ] = False,
) -> None:
    """Render the inference-replica Space(s) (inference_space/) and create or update them on the Hub."""
    import os
    import tempfile

    from huggingface_hub import get_token

    from sparsesync.deploy.inference import boot_line, inference_space_specs
    from sparsesync.deploy.inference import s3_credentials as aws_settings
    from sparsesync.deploy.space import apply, plan, render

    # sent only as the Space secret HF_TOKEN (reads private buckets); read locally, no network. A
    # dry run without one still shows the step the real plan has (with a token, or it fails)
    token = get_token()
    secrets = aws_settings(bucket, os.environ) if s3_credentials else {}
    if bucket.startswith("s3://") and not s3_credentials:
        typer.echo("note: an s3:// run: the Spaces get no S3 credentials unless you pass --s3-credentials "
                   "(sends this shell's AWS_* settings as Space secrets)")
    key = _api_key(space, api_key, public, dry_run, "SPARSESYNC_API_KEY")  # one key for all the replicas
    specs = inference_space_specs(
        space,
        bucket=bucket,
        model=model,
        engine=engine,
        hardware=hardware,
        regions=region,
        replicas=replicas,
        private=not public,
        token=token or (_placeholder() if dry_run else None),
        poll_interval=poll_interval,
        allow_local_bucket=dry_run,
        api_key=key,
        extra_secrets=secrets,
    )
    root = out if out is not None else Path(tempfile.mkdtemp(prefix="sparsesync-inference-space-"))
    plans = []
    for spec in specs:
        folder = render(spec, root if len(specs) == 1 else root / spec.space_id.split("/")[-1])
        plans.append(plan(spec, folder))
        typer.echo(_rendered(folder, out))
        typer.echo(plans[-1].describe())
    if dry_run:
        typer.echo(
            "dry run: nothing sent. Boot one locally (secrets from your shell): "
            f"{boot_line(specs[0], plans[0].folder, engine)}"
        )
        return
    for p in plans:
        typer.echo(f"deployed {apply(p, token=token)}")
