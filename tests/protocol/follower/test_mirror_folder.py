"""The mirror folder is shared ground (issue 47 item 5): what another process in it can do.

A same-user process with write access to the mirror folder (another container on the same
volume, a co-tenant) is played by code that acts at the worst moment: while a mirror file is
being made (`os.posix_fallocate` reserving its blocks, wrapped to snoop), it opens every file the
folder shows and keeps the descriptors, later writing or truncating through them. Checked: the
folder never shows the mirror file (nothing to open, write or truncate: no wrong bytes, no
SIGBUS); a full load from a mirror whose bytes were changed anyway (written through its map, as a
process that reached the file would) is refused and the replica reloads from the run; the
folder probe never writes through a planted link; a file named like an old mirror file is never
removed; a full mirror file system (a 1 MiB tmpfs in a private mount namespace) still loads
anchors, with the mirror in anonymous memory.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsesync.codec import tensor_digests
from sparsesync.errors import StoreError
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.follower.mirror import MirrorDir, create_unlinked, is_file_backed, is_full
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.publisher import Publisher

ROOT = Path(__file__).resolve().parents[3]


def _versions(n_tensors: int = 3, numel: int = 1 << 14) -> list[dict[str, torch.Tensor]]:
    """Version 0 and version 1, which changes only tensor 't0' (the others: bytes no delta touches)."""
    g = torch.Generator().manual_seed(7)
    v0 = {f"t{i}": torch.randn(numel, generator=g).to(torch.bfloat16) for i in range(n_tensors)}
    v1 = dict(v0, t0=v0["t0"].clone())
    v1["t0"][:: 97] = torch.randn(v1["t0"][:: 97].numel(), generator=g).to(torch.bfloat16)
    return [v0, v1]


def _publish(url: str, state: dict[str, torch.Tensor], version: int) -> None:
    with Publisher(url, anchor_every=0) as pub:
        pub.publish(state, version)
        pub.flush()


class _Snooper:
    """Opens every file the mirror folder shows while a mirror file is being made, keeps them."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fds: list[int] = []
        real = os.posix_fallocate

        def snoop(fd: int, offset: int, length: int) -> None:
            real(fd, offset, length)
            for name in os.listdir(folder):
                try:
                    self.fds.append(os.open(folder / name, os.O_RDWR))
                except OSError:
                    pass

        monkeypatch.setattr(os, "posix_fallocate", snoop)


def test_the_folder_never_shows_the_mirror_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the file was created by name and reopened by path before it was unlinked; a process
    that opened it then wrote into the replica's weights at will (no later check reads them)."""
    mdir = tmp_path / "mirror"
    url = str(tmp_path / "run")
    v0, _ = _versions()
    _publish(url, v0, 0)
    snooper = _Snooper(mdir, monkeypatch)
    f = Follower(url, mirror_dir=mdir, prefetch=False)
    assert f.sync_once() == 0
    for fd in snooper.fds:  # what a process holding the file would do with it
        os.pwrite(fd, b"\xff" * 4096, 0)
    assert snooper.fds == [] and list(mdir.iterdir()) == []
    assert all(is_file_backed(t) for t in f.mirror.values()) and str(mdir) in Path("/proc/self/maps").read_text()
    assert tensor_digests(f.mirror) == tensor_digests(v0)


def test_a_file_system_without_o_tmpfile_gets_a_random_name_unlinked_at_once(tmp_path: Path) -> None:
    fd = create_unlinked(tmp_path, tmpfile=False)
    try:
        assert os.fstat(fd).st_nlink == 0 and list(tmp_path.iterdir()) == []
        os.pwrite(fd, b"x", 0)
    finally:
        os.close(fd)


_TRUNCATE = """
import os, sys
from pathlib import Path
from sparsesync.codec import tensor_digests
from sparsesync.protocol.follower.follower import Follower
mdir = Path(sys.argv[2])
fds, real = [], os.posix_fallocate
def snoop(fd, offset, length):
    real(fd, offset, length)
    for name in os.listdir(mdir):
        try:
            fds.append(os.open(mdir / name, os.O_RDWR))
        except OSError:  # (the anchor's staging folder)
            pass
os.posix_fallocate = snoop
f = Follower(sys.argv[1], mirror_dir=mdir, prefetch=False)
assert f.sync_once() == 0
for fd in fds:
    os.ftruncate(fd, 0)  # every page of the map past the new end now faults with SIGBUS
print("opened", len(fds), "read", len(tensor_digests(f.mirror)), flush=True)
"""


def test_truncating_what_the_folder_shows_cannot_kill_the_replica(tmp_path: Path) -> None:
    """Before: the replica died of SIGBUS reading its mirror once another process truncated the file."""
    url = str(tmp_path / "run")
    _publish(url, _versions()[0], 0)
    p = subprocess.run([sys.executable, "-c", _TRUNCATE, url, str(tmp_path / "mirror")], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and "opened 0 read 3" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])


class _Engine(ApplyHook):
    """An engine's own copy of the weights; each call kind fails as often as `fail` says."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.fail = {"load_full": 0, "apply_sparse": 0}

    def _maybe_fail(self, kind: str) -> None:
        if self.fail[kind]:
            self.fail[kind] -= 1
            raise RuntimeError(f"injected: {kind} failed")

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        self._maybe_fail("load_full")
        self.weights = {k: t.clone() for k, t in tensors.items()}

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        self._maybe_fail("apply_sparse")
        for name, u in updates.items():
            self.weights[name].view(-1)[u.indices] = u.values


@pytest.mark.parametrize("part_bytes", [None, 8 << 10], ids=["one-file", "parts"])
@pytest.mark.parametrize("path", ["recovery", "reload"])
def test_a_full_load_from_a_changed_mirror_reloads_from_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 path: str, part_bytes: int | None) -> None:
    """Bytes of a tensor the next version does not touch change in the mirror's file. "recovery":
    the engine fails to take the next version, so the follower reloads it from the mirror;
    "reload": the engine missed a version, and gets the whole mirror at the next sync. Either way
    the mirror's bytes are checked against the version's digests first: the mismatch is logged,
    naming the tensor, and the replica reloads from the run (anchor, then delta) and serves the
    version bit-exact. Before: the engine was loaded with the changed bytes and the version was
    reported as verified."""
    url = str(tmp_path / "run")
    v0, v1 = _versions()
    engine = _Engine()
    f = Follower(url, engine, mirror_dir=tmp_path / "mirror", prefetch=False)  # type: ignore[arg-type]
    with Publisher(url, anchor_every=0, **({"part_bytes": part_bytes} if part_bytes else {})) as pub:
        pub.publish(v0, 0)
        pub.flush()
        assert f.sync_once() == 0
        pub.publish(v1, 1)  # a delta: only 't0' changes
        pub.flush()
    assert not Run(url).commits()[1].has_anchor
    if path == "reload":
        engine.fail.update(apply_sparse=1, load_full=1)  # the engine's bits unknown: no version reported
        assert f.sync_once() is None and f.status().state == "degraded"
    else:
        engine.fail.update(apply_sparse=1)
    f.mirror["t2"].view(torch.int16)[:64] ^= 0x40  # written through the shared map, as into the file
    with caplog.at_level(logging.WARNING):
        assert f.sync_once() == 1
    assert tensor_digests(engine.weights) == tensor_digests(v1), "the engine was loaded with the changed mirror"
    assert tensor_digests(f.mirror) == tensor_digests(v1) and f.status().state == "following"
    assert f.status().anchor_loads == 2
    assert "tensor 't2': digest" in caplog.text, caplog.text
    if not (part_bytes and path == "recovery"):  # (a version in parts checks every unit's base digest as it applies)
        assert "the mirror of version 1: tensor 't2': digest" in caplog.text, caplog.text


def test_the_probe_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """Before: the probe wrote `.probe-<pid>` by name, truncating whatever a planted link there
    pointed at, and then removed the link."""
    mdir, victim = tmp_path / "mirror", tmp_path / "precious.txt"
    mdir.mkdir()
    victim.write_text("keep me")
    (mdir / f".probe-{os.getpid()}").symlink_to(victim)
    got = MirrorDir(mdir).allocate({"w": (torch.bfloat16, (64, 64))})
    assert is_file_backed(got["w"])
    assert victim.read_text() == "keep me" and (mdir / f".probe-{os.getpid()}").is_symlink()


_FOREIGN = """
import os, sys, torch
from pathlib import Path
from sparsesync.protocol.follower.mirror import MirrorDir, is_file_backed
mdir = Path(sys.argv[1])
mdir.mkdir()
theirs = mdir / f"mirror-{os.getpid()}-0.bin"  # another container's follower, with the same pid
theirs.write_bytes(b"their weights")
got = MirrorDir(mdir).allocate({"w": (torch.bfloat16, (64, 64))})
print("file-backed", is_file_backed(got["w"]), "theirs", theirs.exists() and theirs.read_bytes() == b"their weights")
"""


def test_a_file_the_follower_did_not_create_is_never_removed(tmp_path: Path) -> None:
    """Before: the follower's first mirror file was `mirror-<pid>-0.bin`; when that name existed
    (another container's, same pid, same volume) it removed it and fell back to memory."""
    p = subprocess.run([sys.executable, "-c", _FOREIGN, str(tmp_path / "mirror")], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and "file-backed True theirs True" in p.stdout, (p.stdout, p.stderr[-2000:])


_FULL = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from sparsesync.codec import tensor_digests
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.mirror import is_file_backed
f = Follower(sys.argv[1], mirror_dir=sys.argv[2], prefetch=False)
print("version", f.sync_once(), f.status().state, f.status().last_error, flush=True)
backed = any(is_file_backed(t) for t in f.mirror.values())
print("digests", sorted(tensor_digests(f.mirror).items()), "file-backed", backed)
"""


def test_a_full_mirror_file_system_loads_anchors_into_memory(tmp_path: Path) -> None:
    """The mirror folder is a 1 MiB tmpfs (a private mount namespace: no root needed where user
    namespaces are allowed) and the anchor 2 MiB: the anchor is staged in the system's temp dir
    and the mirror kept in anonymous memory, with one warning. Before: every attempt failed on
    ENOSPC while staging the anchor in the mirror folder, retried for ever."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a private tmpfs")
    url, mdir = str(tmp_path / "run"), tmp_path / "full"
    mdir.mkdir()
    v0 = {f"t{i}": t for i, t in enumerate(torch.randn(2, 1 << 19).to(torch.bfloat16))}
    _publish(url, v0, 0)
    cmd = ["unshare", "--mount", "--map-root-user", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"',
           str(mdir), sys.executable, "-c", _FULL, url, str(mdir)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0 and "mount" in p.stderr and "version" not in p.stdout:
        pytest.skip(f"no private tmpfs here: {p.stderr.strip()[-200:]}")
    assert "version 0 following None" in p.stdout, (p.stdout, p.stderr[-2000:])
    assert f"digests {sorted(tensor_digests(v0).items())} file-backed False" in p.stdout
    full = [line for line in p.stderr.splitlines() if line.startswith("WARNING") and "is full" in line]
    assert len(full) == 1 and "anonymous memory" in full[0], p.stderr
    assert "cannot map" not in p.stderr  # the one warning says it all


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_file_system_is_recognised_through_a_store_error(code: int) -> None:
    try:
        try:
            raise OSError(code, os.strerror(code))
        except OSError as e:
            raise StoreError("download of x failed", url="x") from e
    except StoreError as e:
        assert is_full(e)
    assert not is_full(StoreError("download of x failed")) and not is_full(OSError(errno.EACCES, "denied"))
