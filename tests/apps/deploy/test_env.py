"""`sparsesync deploy env`: render, plan, dry-run CLI, the rendered folder booting as a plain
process, and `apply` through the real huggingface_hub client.

tests/support/hub_server.py stands in for the Hub's bucket routes only (no repo creation, commits,
variables, secrets or hardware), so `apply` runs here against `_SpaceHub`, a minimal stand-in for
exactly the Space routes HfApi calls, at the wire boundary.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.deploy import space
from sparsesync.deploy.env import env_space_spec
from sparsesync.deploy.errors import DeployError

TOKEN = "hf_deployTestToken0000000"
SECRET = "hf_secretValueNeverPrinted42"


def test_render_and_plan(tmp_path):
    spec = env_space_spec("me/env", task="repeat", max_sessions=8)
    folder = space.render(spec, tmp_path / "space")
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {"Dockerfile", "README.md", "requirements.txt", "env_space/__main__.py", "env_space/server.py",
            "env_space/words/answers.txt", "env_space/words/allowed.txt"} <= files
    assert not any("__pycache__" in f or f in ("env_space/Dockerfile", "env_space/README.md") for f in files)
    card = (folder / "README.md").read_text()
    front = card.split("---")[1]
    assert "sdk: docker" in front and "app_port: 8000" in front and 'title: "env (sparsesync env)"' in front
    assert "openenv==" in (folder / "requirements.txt").read_text()

    p = space.plan(spec, folder)
    kinds = [type(op).__name__ for op in p.operations]
    assert kinds[:2] == ["CreateSpace", "UploadFolder"] and kinds[-1] == "RequestHardware"
    create = p.operations[0]
    assert isinstance(create, space.CreateSpace) and create.private and create.sdk == "docker"
    assert {(op.key, op.value) for op in p.operations if isinstance(op, space.SetVariable)} >= {
        ("ENV_TASK", "repeat"), ("ENV_MAX_SESSIONS", "8")}
    assert not any(isinstance(op, space.SetSecret) for op in p.operations)  # the env server needs no token
    assert "private" in p.describe() and "cpu-basic" in p.describe()
    assert space.plan(env_space_spec("me/env", private=False), folder).operations[0].private is False


def test_bad_specs_are_deploy_errors(tmp_path):
    with pytest.raises(DeployError, match="NAMESPACE/NAME"):
        space.render(env_space_spec("no-namespace"), tmp_path / "a")
    with pytest.raises(DeployError, match="unknown task"):
        env_space_spec("me/env", task="chess")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(DeployError, match="not empty"):
        space.render(env_space_spec("me/env"), tmp_path / "full")


def test_secrets_stay_out_of_files_plans_and_reprs(tmp_path):
    base = env_space_spec("me/env")
    spec = space.SpaceSpec(space_id="me/env", sources=base.sources, readme=base.readme, card=base.card,
                           secrets={"HF_TOKEN": SECRET}, ignore=base.ignore)
    folder = space.render(spec, tmp_path / "s")
    p = space.plan(spec, folder)
    for text in (p.describe(), repr(p), repr(spec)):
        assert SECRET not in text
    assert any(isinstance(op, space.SetSecret) and op.key == "HF_TOKEN" for op in p.operations)
    assert all(SECRET.encode() not in f.read_bytes() for f in folder.rglob("*") if f.is_file())
    # a secret that leaked into a file is refused at render time
    leaky = space.SpaceSpec(space_id="me/env", sources=base.sources, readme=base.readme,
                            extra_files={"config.txt": f"token={SECRET}"}, secrets={"HF_TOKEN": SECRET})
    with pytest.raises(DeployError, match="secret HF_TOKEN"):
        space.render(leaky, tmp_path / "leaky")


def test_cli_dry_run_renders_without_network(tmp_path, monkeypatch):
    def no_network(*a: Any, **k: Any) -> None:
        raise AssertionError("dry run must not apply")

    monkeypatch.setattr(space, "apply", no_network)
    out = tmp_path / "rendered"
    res = CliRunner().invoke(app, ["deploy", "env", "--space", "me/env", "--dry-run", "--out", str(out),
                                   "--hardware", "cpu-upgrade"])
    assert res.exit_code == 0, res.output
    assert "create Space me/env (private" in res.output and "request hardware cpu-upgrade" in res.output
    assert (out / "Dockerfile").is_file() and (out / "env_space" / "server.py").is_file()
    bad = CliRunner().invoke(app, ["deploy", "env", "--space", "nope", "--dry-run"])
    assert bad.exit_code != 0


def test_rendered_folder_boots_as_a_plain_process(tmp_path):
    spec = env_space_spec("me/env", task="repeat")
    folder = space.render(spec, tmp_path / "space")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENV_")}
    env.pop("PYTHONPATH", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update(spec.variables, ENV_PORT=str(port), ENV_HOST="127.0.0.1")
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import env_space, sparsesync.access as a; print(env_space.__file__); print(a.__file__)",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    # the rendered copies, not the repo's
    assert all(Path(w).resolve().is_relative_to(folder.resolve()) for w in where), where
    proc = subprocess.Popen([sys.executable, "-m", "env_space"], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 45
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "rendered app did not answer /health"
            time.sleep(0.2)
        r = httpx.post(f"{url}/reset", json={"seed": 2})  # the task comes from the ENV_TASK variable
        assert r.status_code == 200 and r.json()["observation"]["prompt"].startswith("Repeat the letter")
        sid = r.json()["session_id"]
        r = httpx.post(f"{url}/step", json={"action": {"text": "abc"}, "session_id": sid})
        assert r.status_code == 200 and r.json()["done"] is True
    finally:
        proc.terminate()
        proc.wait(timeout=15)


# -- apply against a stand-in for the Hub's Space routes ---------------------------------------------
class _SpaceHub(BaseHTTPRequestHandler):
    """The Space routes HfApi uses: create repo, validate-yaml, preupload, commit, variables, secrets, hardware."""

    repos: dict[str, dict[str, Any]] = {}
    log: list[tuple[str, str, bytes, str]] = []  # method, path, body, authorization

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.log.append(("POST", self.path, body, self.headers.get("Authorization", "")))
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts[:3] == ["api", "repos", "create"]:
            req = json.loads(body)
            rid = f"{req['organization']}/{req['name']}"
            if rid in self.repos:
                return self._reply(409, {"error": "You already created this space repo", "url": f"/spaces/{rid}"})
            self.repos[rid] = {"create": req, "files": {}, "variables": {}, "secrets": {}, "hardware": None}
            return self._reply(200, {"url": f"http://{self.headers['Host']}/spaces/{rid}", "name": rid})
        if parts[:2] == ["api", "validate-yaml"]:  # HfApi checks a README's front matter before committing it
            req = json.loads(body)
            front = req["content"].split("---")[1] if req["content"].startswith("---\n") else ""
            if req["repoType"] == "space" and "sdk: docker" not in front:
                return self._reply(400, {"errors": [{"message": "\"sdk\" is required"}]})
            return self._reply(200, {"warnings": []})
        if parts[:2] != ["api", "spaces"] or len(parts) < 5 or "/".join(parts[2:4]) not in self.repos:
            return self._reply(404, {"error": f"no route POST {self.path}"})
        repo = self.repos["/".join(parts[2:4])]
        route = parts[4]
        if route == "preupload":
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if route == "commit":
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    repo["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return self._reply(
                200,
                {
                    "commitUrl": f"http://{self.headers['Host']}/spaces/{'/'.join(parts[2:4])}/commit/1",
                    "commitOid": "1" * 40,
                },
            )
        if route == "variables":
            req = json.loads(body)
            repo["variables"][req["key"]] = req["value"]
            return self._reply(200, {k: {"value": v} for k, v in repo["variables"].items()})
        if route == "secrets":
            req = json.loads(body)
            repo["secrets"][req["key"]] = req["value"]
            return self._reply(200, {})
        if route == "hardware":
            repo["hardware"] = json.loads(body)["flavor"]
            return self._reply(200, {"stage": "BUILDING", "hardware": {"current": None, "requested": repo["hardware"]}})
        return self._reply(404, {"error": f"no route POST {self.path}"})


@pytest.fixture
def space_hub() -> Any:
    _SpaceHub.repos = {}
    _SpaceHub.log = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SpaceHub)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_apply_creates_a_private_docker_space(space_hub, tmp_path):
    from huggingface_hub import HfApi

    base = env_space_spec("me/env", hardware="cpu-upgrade", region="eu")
    spec = space.SpaceSpec(space_id="me/env", sources=base.sources, readme=base.readme, card=base.card,
                           extra_files=base.extra_files, variables=base.variables, secrets={"HF_TOKEN": SECRET},
                           hardware=base.hardware, region=base.region, ignore=base.ignore)
    folder = space.render(spec, tmp_path / "s")
    p = space.plan(spec, folder)
    api = HfApi(endpoint=space_hub, token=TOKEN)
    assert space.apply(p, api) == "https://huggingface.co/spaces/me/env"

    repo = _SpaceHub.repos["me/env"]
    assert repo["create"]["type"] == "space" and repo["create"]["sdk"] == "docker"
    assert repo["create"]["visibility"] == "private" and repo["create"].get("region") == "eu"
    uploaded = next(op.files for op in p.operations if isinstance(op, space.UploadFolder))
    assert set(repo["files"]) == set(uploaded)
    assert repo["files"]["env_space/server.py"] == (folder / "env_space" / "server.py").read_bytes()
    assert repo["variables"] == dict(spec.variables) and repo["secrets"] == {"HF_TOKEN": SECRET}
    assert repo["hardware"] == "cpu-upgrade"
    # the secret went only to the secrets route; every request carried the caller's token
    for method, path, body, auth in _SpaceHub.log:
        assert auth == f"Bearer {TOKEN}"
        if not path.endswith("/secrets"):
            assert SECRET.encode() not in body, path

    # idempotent: a second apply updates the existing Space
    space.apply(p, api)
    assert len(_SpaceHub.repos) == 1


def test_apply_turns_hub_errors_into_deploy_errors(space_hub, tmp_path):
    from huggingface_hub import HfApi

    spec = env_space_spec("me/env")
    p = space.plan(spec, space.render(spec, tmp_path / "s"))
    broken = space.SpacePlan(p.space_id, p.folder, (space.SetVariable("ghost/space", "ENV_TASK", "wordle"),))
    with pytest.raises(DeployError, match="set variable ENV_TASK=wordle failed: HTTP 404") as e:
        space.apply(broken, HfApi(endpoint=space_hub, token=TOKEN))
    assert TOKEN not in str(e.value)


def test_the_env_space_reads_only_the_standard_library_of_sparsesync(tmp_path):
    """The env Space ships sparsesync/ for its request-body cap (sparsesync.access) and installs none
    of sparsesync's dependencies: that import needs nothing beyond the standard library."""
    folder = space.render(env_space_spec("me/env", task="repeat"), tmp_path / "space")
    code = ("import sys; sys.path.insert(0, '.'); import sparsesync.access; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sparsesync', 'torch', 'numpy')))")
    res = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], cwd=folder, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    loaded = ast.literal_eval(res.stdout.strip())  # the front door's own lazy table may load too: stdlib only
    assert "sparsesync.access" in loaded and not [m for m in loaded if m.split(".")[0] in ("torch", "numpy")], loaded
