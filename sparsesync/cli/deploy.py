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

ApiKey = Annotated[Optional[str], typer.Option(
    help="Key clients must send as `Authorization: Bearer KEY` (a Space secret). Default: generated for a --public Space, none for a private one.",
    envvar="SPARSESYNC_DEPLOY_API_KEY", show_envvar=True)]


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


app = typer.Typer(help="Deploy the environment and inference replicas as Hugging Face Spaces.", no_args_is_help=True)


@app.command("env")
def env(
    space: Annotated[str, typer.Option(help="The Space to create or update, NAMESPACE/NAME.")],
    hardware: Annotated[str, typer.Option(help="Space hardware flavor (cpu-basic, cpu-upgrade, ...).")] = "cpu-basic",
    public: Annotated[bool, typer.Option("--public", help="Make the Space public (default: private).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Render the folder and print the plan; no network.")] = False,
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
    from sparsesync.deploy.space import apply, plan, render

    key = _api_key(space, api_key, public, dry_run, "ENV_API_KEY")
    spec = env_space_spec(space, hardware=hardware, private=not public, region=region, task=task,
                          max_sessions=max_sessions, idle_timeout_s=idle_timeout, api_key=key)
    folder = render(spec, out if out is not None else Path(tempfile.mkdtemp(prefix="sparsesync-env-space-")))
    the_plan = plan(spec, folder)
    typer.echo(f"rendered {folder}")
    typer.echo(the_plan.describe())
    if dry_run:
        env_vars = " ".join([*(f"{k}={v}" for k, v in sorted(spec.variables.items())), *(f"{k}=***" for k in sorted(spec.secrets))])
        typer.echo(f"dry run: nothing sent. Boot it locally: cd {folder} && {env_vars} python -m env_space")
        return
    url = apply(the_plan)
    typer.echo(f"deployed {url}")


@app.command("inference")
def inference(
    space: Annotated[str, typer.Option(help="The Space to create or update, NAMESPACE/NAME (NAME-1..K with --replicas K).")],
    bucket: Annotated[str, typer.Option(help="Run URL the replicas follow: hf://buckets/NS/NAME/PREFIX or s3://...")],
    model: Annotated[str, typer.Option(help="Initial weights: a local model folder (copied into the Space) or a Hub model id.")],
    engine: Annotated[str, typer.Option(help="Inference engine: vllm or embedded.")] = "vllm",
    hardware: Annotated[Optional[str], typer.Option(help="Space hardware flavor (default l4x1 for vllm, cpu-upgrade for embedded).")] = None,
    region: Annotated[Optional[list[str]], typer.Option(help="Hub region (us or eu); repeat to spread replicas round-robin.")] = None,
    replicas: Annotated[int, typer.Option(help="Number of replica Spaces.")] = 1,
    poll_interval: Annotated[float, typer.Option(help="Seconds between checks for new versions.")] = 1.0,
    public: Annotated[bool, typer.Option("--public", help="Make the Spaces public (default: private).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Render the folders and print the plans; no network.")] = False,
    out: Annotated[Optional[Path], typer.Option(help="Render into this (empty or new) folder (one sub-folder per replica when K > 1).")] = None,
    api_key: ApiKey = None,
) -> None:
    """Render the inference-replica Space(s) (inference_space/) and create or update them on the Hub."""
    import tempfile

    from sparsesync.deploy.inference import inference_space_specs
    from sparsesync.deploy.space import apply, plan, render

    token = None
    if not dry_run:
        from huggingface_hub import get_token

        token = get_token()  # sent only as the Space secret HF_TOKEN (reads private buckets)
    key = _api_key(space, api_key, public, dry_run, "SPARSESYNC_API_KEY")  # one key for all the replicas
    specs = inference_space_specs(space, bucket=bucket, model=model, engine=engine, hardware=hardware, regions=region,
                                  replicas=replicas, private=not public, token=token, poll_interval=poll_interval,
                                  allow_local_bucket=dry_run, api_key=key)
    root = out if out is not None else Path(tempfile.mkdtemp(prefix="sparsesync-inference-space-"))
    plans = []
    for spec in specs:
        folder = render(spec, root if len(specs) == 1 else root / spec.space_id.split("/")[-1])
        plans.append(plan(spec, folder))
        typer.echo(f"rendered {folder}")
        typer.echo(plans[-1].describe())
    if dry_run:
        env_vars = " ".join([*(f"{k}={v}" for k, v in sorted(specs[0].variables.items()) if k not in ("HOST",)),
                             *(f"{k}=***" for k in sorted(specs[0].secrets))])
        boot = ("VLLM_PLUGINS=sparsesync python -m sparsesync.integrations.vllm serve model "
                "--weight-transfer-config '{\"backend\": \"sparsesync\"}'") if engine == "vllm" else "python -m inference_space"
        typer.echo(f"dry run: nothing sent. Boot one locally: cd {plans[0].folder} && {env_vars} {boot}")
        return
    for p in plans:
        typer.echo(f"deployed {apply(p, token=token)}")
