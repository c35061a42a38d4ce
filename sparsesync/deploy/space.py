"""Docker Spaces, generically: describe one (`SpaceSpec`), render it to a folder, plan, apply.

`render(spec, out)` writes the complete Space folder locally (app files, extra files, the README
card with its YAML front matter filled in). `plan(spec, folder)` lists the typed operations that
would create or update the Space; `--dry-run` prints them and stops there. `apply(plan)` runs them
in order through `huggingface_hub.HfApi`: create the repo (private unless asked, sdk docker,
optional region), upload the folder, set variables, set secrets, request hardware.

Guarantees:
- Private by default (`SpaceSpec.private=True`).
- Secrets only as Space secrets: a secret's value is never written into the rendered folder
  (`render` refuses if any file contains one), never in a plan's text or repr, never in errors.
  A variable whose value carries a credential (URL userinfo, a token or secret query parameter,
  an hf_/AKIA key) is refused: it must be a secret. `redact` masks such values for display.
- Dotfiles and dot-folders (`.env`, `.git/`, `.hg/`, `.svn/`, ...) and VCS folders are never
  copied into the rendered folder, so never uploaded.
- Nothing touches the network before `apply`.
- `apply` is idempotent: re-running it on an existing Space updates it (`exist_ok=True`).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sparsesync.deploy.errors import DeployError

if TYPE_CHECKING:
    from huggingface_hub import HfApi

SPACE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
KEY_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# *.so: compiled by the image itself; ".*": dotfiles and dot-folders (.env, .git/, .hg/, .svn/) never leave the machine
DEFAULT_IGNORE = ("__pycache__", "*.pyc", "*.pyo", "*.so", ".*", "CVS", "_darcs")


def redact(value: str) -> str:
    """`value` with credentials (URL userinfo, secret query parameters, tokens) masked."""
    from sparsesync.store.retry import redact as _redact

    return _redact(value)


def shell_env(spec: SpaceSpec, skip: Sequence[str] = ("HOST",)) -> list[str]:
    """`NAME=value` words that give a local process the Space's variables, and `NAME="$NAME"`
    for each secret: a reference to a shell variable the user sets (a value is never printed)."""
    import shlex

    words = [f"{k}={shlex.quote(v)}" for k, v in sorted(spec.variables.items()) if k not in skip]
    return words + [f'{k}="${k}"' for k in sorted(spec.secrets)]


def has_credentials(value: str) -> bool:
    """Whether `value` carries something `redact` would mask."""
    return redact(value) != value


def resolve_api_key(given: str | None, public: bool) -> tuple[str | None, bool]:
    """The API key a Space's server requires: `given`, else a new random one for a public Space
    (a private Space is guarded by the Hub), else None. Returns (key, whether it was generated)."""
    if given:
        return given, False
    if not public:
        return None, False
    import secrets

    return "sk-" + secrets.token_urlsafe(32), True


def save_api_key(space_id: str, key: str) -> Path:
    """Write a generated key where only this user can read it (mode 600, outside any rendered
    folder): $XDG_CONFIG_HOME/sparsesync/api-keys/NS__NAME.key."""
    import os

    root = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "sparsesync" / "api-keys"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = root / (space_id.replace("/", "__") + ".key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(path, 0o600)
    return path


def mask(key: str) -> str:
    """A key as it may be shown: its first 5 and last 2 characters."""
    return f"{key[:5]}...{key[-2:]}" if len(key) > 12 else "***"


@dataclass(frozen=True)
class SpaceSpec:
    """Everything that defines a Docker Space. Paths are local; nothing here is secret but `secrets`."""

    space_id: str  # "namespace/name"
    sources: Mapping[str, Path]  # path in the Space -> local file or folder to copy there
    readme: Path  # the card template: a README.md with YAML front matter
    card: Mapping[str, object] = field(default_factory=dict)  # front-matter keys to set (title, app_port, ...)
    extra_files: Mapping[str, str] = field(default_factory=dict)  # path in the Space -> text
    variables: Mapping[str, str] = field(default_factory=dict)  # Space variables (public config)
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)  # Space secrets (e.g. HF_TOKEN)
    hardware: str = "cpu-basic"  # a Space hardware flavor: cpu-basic, cpu-upgrade, t4-small, a10g-small, ...
    private: bool = True  # private unless explicitly asked
    region: str | None = None  # "us" | "eu" | None (Hub default)
    ignore: Sequence[str] = DEFAULT_IGNORE  # name patterns skipped when copying folders

    def validate(self) -> None:
        if not SPACE_ID_RE.match(self.space_id):
            raise DeployError(f"Space id {self.space_id!r} is not of the form NAMESPACE/NAME",
                              space_id=self.space_id, hint="pass --space your-user/your-space")
        for kind, mapping in (("variable", self.variables), ("secret", self.secrets)):
            for key in mapping:
                if not KEY_RE.match(key):
                    raise DeployError(f"{kind} name {key!r} is not an UPPER_SNAKE_CASE identifier",
                                      space_id=self.space_id, hint="rename it, e.g. ENV_TASK")
        for key, value in self.variables.items():
            if has_credentials(value):
                raise DeployError(f"variable {key}={redact(value)!r} carries a credential", space_id=self.space_id,
                                  hint="Space variables are readable by anyone who sees the Space; pass it as a secret")
        both = set(self.variables) & set(self.secrets)
        if both:
            raise DeployError(f"{sorted(both)} given both as variable and as secret", space_id=self.space_id,
                              hint="a secret must only be a secret")
        if self.region not in (None, "us", "eu"):
            raise DeployError(f"region {self.region!r} is not 'us' or 'eu'", space_id=self.space_id)
        for dest, src in self.sources.items():
            if not Path(src).exists():
                raise DeployError(f"source {src} for {dest!r} does not exist", space_id=self.space_id)
        if not Path(self.readme).is_file():
            raise DeployError(f"card template {self.readme} does not exist", space_id=self.space_id)


# -- typed operations ------------------------------------------------------------------------
@dataclass(frozen=True)
class CreateSpace:
    space_id: str
    private: bool
    sdk: str = "docker"
    region: str | None = None

    def describe(self) -> str:
        where = f", region {self.region}" if self.region else ""
        return (
            f"create Space {self.space_id} ({'private' if self.private else 'PUBLIC'}, sdk {self.sdk}{where}) if absent"
        )


@dataclass(frozen=True)
class UploadFolder:
    space_id: str
    folder: Path
    files: tuple[str, ...]

    def describe(self) -> str:
        return f"upload {len(self.files)} files from {self.folder}: {', '.join(self.files)}"


@dataclass(frozen=True)
class SetVariable:
    space_id: str
    key: str
    value: str

    def describe(self) -> str:
        return f"set variable {self.key}={self.value}"


@dataclass(frozen=True)
class SetSecret:
    space_id: str
    key: str
    value: str = field(repr=False)  # never printed

    def describe(self) -> str:
        return f"set secret {self.key} (value hidden)"


@dataclass(frozen=True)
class RequestHardware:
    space_id: str
    hardware: str

    def describe(self) -> str:
        return f"request hardware {self.hardware}"


Operation = CreateSpace | UploadFolder | SetVariable | SetSecret | RequestHardware


@dataclass(frozen=True)
class SpacePlan:
    """The operations `apply` runs, in order, and the rendered folder they upload."""

    space_id: str
    folder: Path
    operations: tuple[Operation, ...]

    @property
    def url(self) -> str:
        return f"https://huggingface.co/spaces/{self.space_id}"

    def describe(self) -> str:
        lines = [f"plan for {self.url}:"]
        lines += [f"  {i}. {op.describe()}" for i, op in enumerate(self.operations, start=1)]
        return "\n".join(lines)


# -- render / plan / apply -------------------------------------------------------------------
def render(spec: SpaceSpec, out: Path) -> Path:
    """Write the Space folder for `spec` into `out` (created; must be empty). Returns `out`."""
    spec.validate()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise DeployError(f"output folder {out} is not empty", space_id=spec.space_id,
                          hint="pass an empty or new folder to --out")
    out.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns(*spec.ignore)
    for dest, src in spec.sources.items():
        target = _inside(out, dest, spec.space_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(src).is_dir():
            shutil.copytree(src, target, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, target)
    for dest, text in spec.extra_files.items():
        target = _inside(out, dest, spec.space_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    card = render_card(Path(spec.readme).read_text(encoding="utf-8"), spec.card)
    (out / "README.md").write_text(card, encoding="utf-8")
    _check_no_secrets(spec, out)
    return out


def render_card(template: str, values: Mapping[str, object]) -> str:
    """`template` (a README with `---` YAML front matter of flat `key: value` lines) with `values` set."""
    m = re.match(r"^---\n(.*?)\n---\n", template, flags=re.S)
    if not m:
        raise DeployError("the Space card template has no YAML front matter (--- ... --- at the top)",
                          hint="start README.md with the Space's front matter (sdk: docker, app_port: ...)")
    lines = m.group(1).split("\n")
    todo = dict(values)
    for i, line in enumerate(lines):
        key = line.split(":", 1)[0].strip()
        if ":" in line and not line.startswith((" ", "-")) and key in todo:
            lines[i] = f"{key}: {_yaml_scalar(todo.pop(key))}"
    lines += [f"{k}: {_yaml_scalar(v)}" for k, v in todo.items()]
    return "---\n" + "\n".join(lines) + "\n---\n" + template[m.end():]


def plan(spec: SpaceSpec, folder: Path) -> SpacePlan:
    """The operations that create or update the Space from the rendered `folder`."""
    spec.validate()
    folder = Path(folder)
    files = tuple(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()))
    ops: list[Operation] = [CreateSpace(spec.space_id, private=spec.private, region=spec.region),
                            UploadFolder(spec.space_id, folder, files)]
    ops += [SetVariable(spec.space_id, k, v) for k, v in sorted(spec.variables.items())]
    ops += [SetSecret(spec.space_id, k, v) for k, v in sorted(spec.secrets.items())]
    ops.append(RequestHardware(spec.space_id, spec.hardware))
    return SpacePlan(spec.space_id, folder, tuple(ops))


def apply(space_plan: SpacePlan, api: HfApi | None = None, *, token: str | None = None) -> str:
    """Run the plan's operations in order; returns the Space URL. Errors become `DeployError`."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = api or HfApi(token=token)
    for op in space_plan.operations:
        try:
            _run(api, op)
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else "?"
            hint = ("check that HF_TOKEN has write access to this namespace" if status in (401, 403)
                    else "re-run the command: every step is idempotent")
            what = op.describe().split(":")[0]  # an upload's file list stays in the plan
            raise DeployError(f"{what} failed: HTTP {status}", space_id=space_plan.space_id,
                              hint=hint) from None
    return space_plan.url


def _run(api: HfApi, op: Operation) -> None:
    if isinstance(op, CreateSpace):
        api.create_repo(op.space_id, repo_type="space", space_sdk=op.sdk, private=op.private, exist_ok=True,
                        # the Hub's Literal of regions; the user's string, checked by the Hub
                        region=op.region)  # type: ignore[arg-type]
    elif isinstance(op, UploadFolder):
        api.upload_folder(repo_id=op.space_id, repo_type="space", folder_path=op.folder,
                          commit_message="sparsesync deploy")
    elif isinstance(op, SetVariable):
        api.add_space_variable(op.space_id, op.key, op.value)
    elif isinstance(op, SetSecret):
        api.add_space_secret(op.space_id, op.key, op.value)
    elif isinstance(op, RequestHardware):
        # the Hub's SpaceHardware enum takes its string value
        api.request_space_hardware(op.space_id, op.hardware)  # type: ignore[arg-type]
    else:  # pragma: no cover - the Operation union is closed
        raise DeployError(f"unknown operation {op!r}")


def _inside(out: Path, dest: str, space_id: str) -> Path:
    target = (out / dest).resolve()
    if not target.is_relative_to(out.resolve()) or target == out.resolve():
        raise DeployError(f"path {dest!r} escapes the Space folder", space_id=space_id)
    return target


def _check_no_secrets(spec: SpaceSpec, out: Path) -> None:
    secrets = {k: v.encode() for k, v in spec.secrets.items() if len(v) >= 6}  # shorter ones match by chance
    for p in out.rglob("*"):
        if p.is_file() and secrets:
            data = p.read_bytes()
            for key, v in secrets.items():
                if v in data:
                    raise DeployError(f"the value of secret {key} appears in {p.relative_to(out)}",
                                      space_id=spec.space_id, hint="secrets go only to Space secrets; remove it")


def _yaml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if re.fullmatch(r"[A-Za-z0-9_./ -]+", text) and text[0] not in "-?: " and text not in ("true", "false"):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
