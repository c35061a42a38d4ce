"""Both Space images built from the rendered folders and booted (scripts/space_images.sh).

The script renders the Space folders with the real `sparsesync deploy ... --dry-run`, builds
each Dockerfile unmodified with buildah on a locally made `python:3.11-slim`, boots the env
image (HEALTHCHECK, /health, a Wordle episode over HTTP) and the replica image (uid 1000,
follows a folder bucket the host publishes into, serves the newest version), and resolves the
vLLM variant's requirements. Needs root, buildah, podman, debootstrap and the package index;
about 10-15 minutes on 2 cores (the base image is cached after the first run).
Opt-in (SPARSESYNC_SPACE_IMAGES=1): it would take a third of CI's time budget on its own, and
CI's machines need the Debian tools and the Debian mirror for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("buildah") is None or shutil.which("debootstrap") is None,
                       reason="needs buildah, podman and debootstrap (apt-get install -y buildah podman debootstrap)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="buildah --isolation chroot and ip netns need root"),
    pytest.mark.skipif(os.environ.get("SPARSESYNC_SPACE_IMAGES") != "1",
                       reason="opt-in: SPARSESYNC_SPACE_IMAGES=1 (builds and boots both Space images, 5-10 minutes)"),
]


@pytest.mark.timeout(3600)
def test_space_images_build_and_boot(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    env = {**os.environ, "PYTHON": sys.executable, "SPACE_IMAGES_WORK": str(tmp_path / "work")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "space_images.sh"), str(summary)], env=env,
                          capture_output=True, text=True, timeout=3500)
    assert summary.is_file(), proc.stderr[-4000:]
    s = json.loads(summary.read_text())
    assert proc.returncode == 0 and s["ok"] is True, (s.get("error"), proc.stderr[-4000:])

    for name in ("env-space", "replica-space"):
        build = s[f"build_{name}"]
        assert build["seconds"] > 0 and build["size_bytes"] > s["base_size_bytes"], build

    env_boot = s["boot_env"]
    assert env_boot["healthcheck"] is True and env_boot["uid"] == 1000
    assert 1 <= env_boot["wordle"]["turns"] <= 6 and len(env_boot["wordle"]["rewards"]) == env_boot["wordle"]["turns"]

    replica = s["boot_replica"]
    assert replica["healthcheck"] is True and replica["uid"] == 1000
    assert replica["follow"]["weight_version"] == replica["follow"]["newest"] == 4
    assert replica["follow"]["state"] == "following"
    # a CPU Space gets the CPU build of torch (a bare `torch` is a multi-GB CUDA build)
    assert replica["torch"].endswith("+cpu"), replica["torch"]
    assert env_boot["stopped_on_sigterm"] is True and replica["stopped_on_sigterm"] is True

    resolved = s["resolve_vllm"]["resolved"]
    assert resolved["vllm"] and resolved["torch"] and not resolved["torch"].endswith("+cpu"), resolved
