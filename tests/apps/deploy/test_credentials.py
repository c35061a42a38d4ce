"""Credentials never leak through `sparsesync deploy`: not printed, not in Space variables, not
uploaded; a public Space always gets an API key, as a secret.

`apply` runs through the real huggingface_hub client against `_SpaceHub` (tests/apps/deploy/test_env.py),
which records every request at the wire boundary.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.deploy import space
from sparsesync.deploy.errors import DeployError
from sparsesync.deploy.inference import inference_space_specs
from sparsesync.tiny_model import build_tiny_model
from tests.apps.deploy.test_env import TOKEN, _SpaceHub, space_hub  # noqa: F401 - the fixture

_real_apply = space.apply
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
BUCKETS = [f"s3://{KEY_ID}:{SECRET}@bucket/run", f"s3://bucket/run?aws_secret_access_key={SECRET}&endpoint=http://h:9"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A model folder with what a user's checkout holds beside the weights."""
    m = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    (m / ".env").write_text(f"AWS_SECRET_ACCESS_KEY={SECRET}\n")
    (m / ".git").mkdir()
    (m / ".git" / "config").write_text(f"[remote]\n url = https://user:{SECRET}@example.com/x\n")
    (m / ".hg").mkdir()
    (m / ".hg" / "hgrc").write_text("x")
    (m / "sub").mkdir()
    (m / "sub" / ".netrc").write_text(SECRET)
    return m


@pytest.mark.parametrize("bucket", BUCKETS)
def test_dry_run_never_prints_bucket_credentials(model, tmp_path, bucket):
    out = tmp_path / "rendered"
    res = CliRunner().invoke(
        app,
        [
            "deploy",
            "inference",
            "--space",
            "me/rep",
            "--bucket",
            bucket,
            "--model",
            str(model),
            "--engine",
            "embedded",
            "--dry-run",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert SECRET not in res.output and KEY_ID not in res.output
    assert (
        "set secret SPARSESYNC_BUCKET (value hidden)" in res.output
        and "set variable SPARSESYNC_BUCKET" not in res.output
    )
    files = [p.relative_to(out).as_posix() for p in out.rglob("*")]
    assert not [f for f in files if any(part.startswith(".") for part in f.split("/"))], files
    assert (out / "model" / "config.json").is_file()
    assert not any(SECRET.encode() in p.read_bytes() for p in out.rglob("*") if p.is_file())


def test_credentials_go_only_to_secrets_and_dotfiles_never_upload(model, tmp_path, space_hub):  # noqa: F811
    from huggingface_hub import HfApi

    (spec,) = inference_space_specs("me/rep", bucket=BUCKETS[0], model=str(model), engine="embedded",
                                    token="hf_tokenValue1234567", api_key="sk-replica-key-123456")
    assert "SPARSESYNC_BUCKET" not in spec.variables and SECRET not in repr(spec)
    p = space.plan(spec, space.render(spec, tmp_path / "s"))
    assert SECRET not in p.describe()
    space.apply(p, HfApi(endpoint=space_hub, token=TOKEN))
    repo = _SpaceHub.repos["me/rep"]
    assert repo["secrets"] == {"HF_TOKEN": "hf_tokenValue1234567", "SPARSESYNC_BUCKET": BUCKETS[0],
                               "SPARSESYNC_API_KEY": "sk-replica-key-123456"}
    assert "SPARSESYNC_BUCKET" not in repo["variables"]
    assert "model/config.json" in repo["files"]
    assert not [f for f in repo["files"] if any(part.startswith(".") for part in f.split("/"))]
    for _method, path, body, _auth in _SpaceHub.log:
        if not path.endswith("/secrets"):
            assert SECRET.encode() not in body, path
    # a hand-built spec that puts a credential in a variable is refused before anything is sent
    leaky = space.SpaceSpec(
        space_id="me/x", sources={}, readme=spec.readme, variables={"SPARSESYNC_BUCKET": BUCKETS[1]}
    )
    with pytest.raises(DeployError, match="carries a credential") as e:
        leaky.validate()
    assert SECRET not in str(e.value)


@pytest.mark.parametrize("kind", ["env", "inference"])
def test_public_space_gets_a_generated_api_key_as_secret(model, tmp_path, monkeypatch, space_hub, kind):  # noqa: F811
    from huggingface_hub import HfApi

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setattr(space, "apply", lambda plan, *a, **k: _real_apply(plan, HfApi(endpoint=space_hub, token=TOKEN)))
    args = ["deploy", kind, "--space", "me/pub", "--public", "--out", str(tmp_path / "out")]
    if kind == "inference":
        args += ["--bucket", "hf://buckets/me/b/run", "--model", str(model), "--engine", "embedded"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    name = "ENV_API_KEY" if kind == "env" else "SPARSESYNC_API_KEY"
    secrets: dict[str, Any] = _SpaceHub.repos["me/pub"]["secrets"]
    key = secrets[name]
    assert len(key) > 30 and key not in res.output and space.mask(key) in res.output
    path = tmp_path / "cfg" / "sparsesync" / "api-keys" / "me__pub.key"
    assert path.read_text().strip() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _SpaceHub.repos["me/pub"]["create"]["visibility"] != "private"
    # private: no key unless asked for
    res = CliRunner().invoke(app, ["deploy", "env", "--space", "me/priv", "--out", str(tmp_path / "out2")])
    assert res.exit_code == 0 and "ENV_API_KEY" not in _SpaceHub.repos["me/priv"]["secrets"]



def test_s3_credentials_reach_the_space_only_as_secrets(model, tmp_path, monkeypatch, space_hub):  # noqa: F811
    """`--s3-credentials`: this shell's AWS_* settings become Space secrets, shown nowhere; an
    s3:// run without it says the Spaces get no credentials."""
    from huggingface_hub import HfApi

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://acct.r2.example.com")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setattr(space, "apply", lambda plan, *a, **k: _real_apply(plan, HfApi(endpoint=space_hub, token=TOKEN)))
    args = ["deploy", "inference", "--space", "me/s3rep", "--bucket", "s3://bucket/run", "--model", str(model),
            "--engine", "embedded"]
    res = CliRunner().invoke(app, [*args, "--dry-run", "--out", str(tmp_path / "dry")])
    assert res.exit_code == 0, res.output
    assert "--s3-credentials" in res.output and "AWS_ACCESS_KEY_ID" not in res.output
    res = CliRunner().invoke(app, [*args, "--s3-credentials", "--dry-run", "--out", str(tmp_path / "dry2")])
    assert res.exit_code == 0, res.output
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        assert f"set secret {name} (value hidden)" in res.output and f'{name}="${name}"' in res.output
    res = CliRunner().invoke(app, [*args, "--s3-credentials", "--out", str(tmp_path / "real")])
    assert res.exit_code == 0, res.output
    repo = _SpaceHub.repos["me/s3rep"]
    assert {k: repo["secrets"][k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")} == {
        "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": "https://acct.r2.example.com"}
    assert not any(k.startswith("AWS_") for k in repo["variables"])
    for _method, path, body, _auth in _SpaceHub.log:
        if not path.endswith("/secrets"):
            assert SECRET.encode() not in body and KEY_ID.encode() not in body, path
    for folder in ("dry", "dry2", "real"):
        assert not any(SECRET.encode() in p.read_bytes() for p in (tmp_path / folder).rglob("*") if p.is_file())
    # asked for, but the key pair is not set here; or not an s3:// run
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    res = CliRunner().invoke(app, [*args, "--s3-credentials", "--dry-run", "--out", str(tmp_path / "dry3")])
    assert isinstance(res.exception, DeployError) and "AWS_SECRET_ACCESS_KEY" in res.exception.message
    res = CliRunner().invoke(
        app,
        [
            "deploy",
            "inference",
            "--space",
            "me/x",
            "--bucket",
            "hf://buckets/me/b/run",
            "--model",
            str(model),
            "--s3-credentials",
            "--dry-run",
            "--out",
            str(tmp_path / "dry4"),
        ],
    )
    assert isinstance(res.exception, DeployError) and "s3://" in res.exception.message
