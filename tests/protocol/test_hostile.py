"""Readers and writers over whatever a run folder holds: a clear one-line error or the right weights.

A real run (4 versions: anchors and deltas, written by the Publisher) is copied and damaged the
ways runs get damaged: hand-edited or forged commit records (wrong JSON shapes and types,
versions and epochs out of range, chains that point forward or in cycles, duplicates under
fencing epochs), objects deleted, truncated, flipped or replaced by FIFOs and links to
/dev/zero. Then every CLI command and a follower run on it, each under a time bound (SIGALRM)
and the whole test under a memory bound (RLIMIT_DATA), and each must end in a one-line error or
a result bit-exact to a committed version; `push` must never report a version readers do not
see, and `gc` must never make the newest version unreadable.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from sparsesync.cli import app
from sparsesync.cli._errors import run_guarded
from sparsesync.codec import diff_state, encode_changes, state_digest, tensor_digests
from sparsesync.codec.anchor import write_anchor_shard
from sparsesync.codec.digest import bytes_digest, file_digest
from sparsesync.codec.patch_reader import read_patch
from sparsesync.errors import SparsesyncError
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.keys import commit_key, parse_commit_key
from sparsesync.protocol.records import CommitRecord
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.store import Store, open_store
from tests.support.weights import assert_bit_equal, make_state, train_step

COMMAND_S = 60  # no command may take longer: a hang fails the test, not the suite (generous for loaded machines)
MEMORY_HEADROOM = 2 << 30  # bytes of heap the whole test may add (runaway reads/loops hit it)


class _Hang(BaseException):
    """Raised by SIGALRM inside a command: a BaseException, so no error handler swallows it."""


@contextlib.contextmanager
def _time_bound(seconds: int, what: str) -> Iterator[None]:
    """Raise (as a test failure) when the block runs past `seconds`. Shares the real-time timer
    with pytest-timeout: the outer deadline is put back, less the time spent, afterwards."""
    def _alarm(*_):  # type: ignore[no-untyped-def]
        raise _Hang(f"{what} ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.monotonic()
    try:
        yield
    except _Hang as e:  # out of the command: now an ordinary test failure (hypothesis shrinks it)
        raise AssertionError(str(e)) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 0.001), interval)


@contextlib.contextmanager
def _memory_bound(headroom: int) -> Iterator[None]:
    """Cap this process's heap (RLIMIT_DATA) at its current size plus `headroom`."""
    vm_data = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmData:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = vm_data + headroom
    resource.setrlimit(resource.RLIMIT_DATA, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _cli(*args: str) -> tuple[int, str, str]:
    """Run `sparsesync ARGS` in-process the way the console script does (through run_guarded)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _time_bound(COMMAND_S, " ".join(args)):
        try:
            run_guarded(lambda: app(list(args), prog_name="sparsesync"))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return code, out.getvalue(), err.getvalue()


def _assert_one_line_error(code: int, out: str, err: str, what: str) -> None:
    assert code == 1, (what, code, out, err)
    assert "Traceback" not in out + err, (what, err)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("skipped ")]
    assert lines and lines[0].startswith("error: "), (what, err)
    assert len(lines) <= 2 and all(ln.startswith("fix: ") for ln in lines[1:]), (what, err)


# -- the run every example starts from ------------------------------------------------------------
@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """A run of versions 1..4 (anchors at 1 and 3, deltas 1->2->3->4) and its states by digest."""
    root = tmp_path_factory.mktemp("hostile") / "run"
    g = torch.Generator().manual_seed(31)
    state = make_state(31)
    states: dict[str, dict[str, torch.Tensor]] = {}
    with Publisher(str(root), anchor_every=2, writer="w1") as pub:
        for v in range(1, 5):
            pub.publish(state, v)
            states[state_digest(tensor_digests(state))] = {k: t.clone() for k, t in state.items()}
            state = train_step(state, g)
    states["next"] = state  # what `push` publishes in the examples
    return root, states


def _records(root: Path) -> list[dict]:
    """The commit records of `root` that are still plain, small JSON objects."""
    out = []
    for p in sorted((root / "commits").iterdir()) if (root / "commits").is_dir() else []:
        if p.is_file() and not p.is_symlink() and p.stat().st_size < 1 << 20:
            with contextlib.suppress(ValueError, RecursionError):
                if isinstance(rec := json.loads(p.read_bytes()), dict):
                    out.append(rec)
    return out


def _objects(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.parts[-2] != "commits"
                  and "writers" not in p.parts)


# -- strategies: damage to a run ------------------------------------------------------------------
_WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 2),
    st.integers(10**10 - 2, 10**13),
    st.floats(),
    st.text(max_size=8),
    st.lists(st.integers(0, 5), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_FIELDS = ["version", "epoch", "base_version", "delta", "anchor", "state_digest", "base_state_digest", "metrics",
           "format", "created_at", "writer"]


@st.composite
def _forged_commit(draw: st.DrawFn) -> tuple:
    """A commit-named object: a real record of another version with fields changed, or raw bytes."""
    version = draw(st.integers(0, 8))
    epoch = draw(st.integers(0, 3))
    kind = draw(st.sampled_from(["edited", "edited", "copy", "raw"]))
    if kind == "raw":
        body = draw(
            st.sampled_from(
                [
                    b"[]",
                    b'"commit"',
                    b"null",
                    b"7",
                    b"{",
                    b"\xff\xfe{}",
                    b"[" * 200_000 + b"]" * 200_000,
                    b'{"format": "sparsesync-commit/1"}',
                ]
            )
        )
        return ("commit", version, epoch, "raw", body, None)
    src = draw(st.integers(0, 3))  # which real record to start from
    changes = draw(st.dictionaries(st.sampled_from(_FIELDS), _WEIRD, max_size=2)) if kind == "edited" else {}
    base = draw(st.one_of(st.none(), st.integers(0, 9)))  # forward-pointing and cyclic bases included
    metric = draw(st.one_of(st.none(), st.sampled_from(["x", [1], {"a": 1}, True, float("nan")])))
    return ("commit", version, epoch, kind, (src, changes, base, metric), None)


_damage = st.one_of(
    _forged_commit(),
    st.tuples(
        st.just("object"),
        st.integers(0, 20),
        st.sampled_from(["delete", "truncate", "flip", "append", "zero-link", "fifo", "folder"]),
    ),
    st.tuples(
        st.just("commit-file"), st.integers(0, 3), st.sampled_from(["delete", "zero-link", "fifo", "huge", "folder"])
    ),
)


def _apply(root: Path, damage: tuple) -> None:
    if damage[0] == "commit":
        _, version, epoch, kind, spec, _ = damage
        path = root / commit_key(version, epoch)
        path.parent.mkdir(exist_ok=True)
        if kind == "raw":
            path.write_bytes(spec)
            return
        src, changes, base, metric = spec
        records = _records(root)
        rec = records[src % len(records)] if records else {}
        rec = {**rec, "version": version, "epoch": epoch}
        if kind == "edited":
            rec["base_version"] = base
            if metric is not None:
                rec.setdefault("metrics", {})["density"] = metric
            rec.update(changes)
        path.write_text(json.dumps(rec))
        return
    _, i, how = damage
    if damage[0] == "object":
        candidates = [root / k for k in _objects(root)]
    else:
        candidates = sorted((root / "commits").iterdir()) if (root / "commits").is_dir() else []
    candidates = [p for p in candidates if p.is_file() and not p.is_symlink()]  # damage each thing once
    if not candidates:
        return
    target = candidates[i % len(candidates)]
    size = target.stat().st_size
    if how in ("delete", "zero-link", "fifo", "folder"):
        target.unlink()
        if how == "zero-link":
            target.symlink_to("/dev/zero")
        elif how == "fifo":
            os.mkfifo(target)
        elif how == "folder":
            (target / "x").mkdir(parents=True)
    elif how == "truncate":
        os.truncate(target, size // 2)
    elif how == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x40
        target.write_bytes(bytes(data))
    elif how == "append":
        with open(target, "ab") as f:
            f.write(b"\0" * 16)
    elif how == "huge":  # a sparse file far larger than any commit record may be
        os.truncate(target, 3 << 30)


# -- what a reader may answer ---------------------------------------------------------------------
def _trusted(url: str) -> dict[int, str]:
    return {c.version: c.state_digest for c in Run(url).commits()}


def _check_pulled(code: int, out: str, err: str, dest: Path, url: str, states: dict, what: str) -> str | None:
    """A pull either fails in one line leaving no DEST, or wrote a committed version bit-exact."""
    if code != 0:
        _assert_one_line_error(code, out, err, what)
        assert not dest.exists(), (what, "a failed pull left", list(dest.parent.iterdir()))
        return None
    m = re.search(r"pulled version (\d+) \(state ((?:xxh3b:)?[0-9a-f]+)\)", out)
    assert m, (what, out)
    version, digest = int(m[1]), m[2]
    assert _trusted(url).get(version) == digest, (what, "pulled a version readers do not trust", version, digest)
    got: dict[str, torch.Tensor] = {}
    for f in [dest] if dest.is_file() else sorted(dest.glob("*.safetensors")):
        got.update(load_file(f))
    assert digest in states, (what, "a state no writer published", digest)
    assert_bit_equal(got, states[digest])
    return digest


def _check_follower(url: str, states: dict, what: str) -> None:
    """What docs/protocol.md promises of a (cold) follower: the newest trusted version bit-exact
    whenever a reader can rebuild it, else state "degraded" with a one-line error naming the object
    (or, with nothing committed, nothing served)."""
    with _time_bound(COMMAND_S, f"rebuild {what}"):
        try:
            rebuilt: int | None = Run(url).reconstruct()[0].version
        except SparsesyncError:
            rebuilt = None
    run = Run(url)
    trusted = {c.version: c.state_digest for c in run.commits()}
    follower = Follower(url)
    try:
        with _time_bound(COMMAND_S, f"follower {what}"):
            served = follower.sync_once()
        st = follower.status()
    finally:
        follower.stop()
    if rebuilt is not None:  # the follower plans the same steps a reader does: it must get there too
        assert served == rebuilt, (
            what,
            "a reader rebuilds version",
            rebuilt,
            "the follower serves",
            served,
            st.last_error,
        )
    if served != max(trusted, default=None):  # short of the newest: degraded, and says why in one line
        err = st.last_error or ""
        assert st.state == "degraded" and err and "\n" not in err, (what, st)
        assert url in err or re.search(r"\b(commits|deltas|anchors)/", err), (what, "the error names no object", err)
    else:  # the newest, or nothing committed at all: a newer name readers refuse is named with its reason (issue 53)
        newer = sorted(k for k in run.rejected if parse_commit_key(k)[0] > max(trusted, default=-1))
        assert [r["key"] for r in st.refused if r["key"] in newer] == newer[::-1][:8], (what, st)
        if newer:
            assert st.state == "degraded" and newer[-1] in (st.last_error or "") and "\n" not in st.last_error, (
                what,
                st,
            )
        else:
            assert st.state == ("following" if trusted else "starting"), (what, st)
    if served is None:
        return
    digest = state_digest(follower.digests)
    assert trusted.get(served) == digest, (what, "the follower serves a version readers do not trust")
    assert st.current_version == served
    assert_bit_equal(follower.mirror, states[digest])


def _objects_listed(url: str, root: Path | None) -> list[tuple[str, int]]:
    """Every object (local: every path) with its size, to tell whether a command deleted anything."""
    if root is not None:
        return sorted((str(p), p.lstat().st_size) for p in root.rglob("*"))
    return sorted((o.key, o.size) for o in open_store(url).list(""))


def _exercise(root: Path | str, states: dict, scratch: Path, what: str) -> None:
    """Every command over the run at `root` (a local folder, or a store URL)."""
    url = str(root)
    root = root if isinstance(root, Path) else None
    deltas = sorted((root / "deltas").iterdir()) if root is not None and (root / "deltas").is_dir() else []
    inspect = [["inspect", str(deltas[0])], ["inspect", f"file://{deltas[-1]}"]] if deltas else []
    for args in (["log", url], ["log", url, "--json"], ["verify", url], ["gc", url, "--dry-run"], *inspect):
        code, out, err = _cli(*args)
        if code != 0 and not (args[0] == "verify" and code == 1 and "versions verified" in out):
            _assert_one_line_error(code, out, err, f"{what}: {args[0]}")
        assert "Traceback" not in out + err
    newest = _check_pulled(
        *_cli("pull", url, str(scratch / "newest")), scratch / "newest", url, states, f"{what}: pull"
    )
    for v in (2, 4):
        dest = scratch / f"v{v}.safetensors"
        _check_pulled(*_cli("pull", url, str(dest), "--version", str(v)), dest, url, states, f"{what}: pull {v}")
    _check_follower(url, states, what)

    before = _objects_listed(url, root)
    trusted_before = _trusted(url)
    code, out, err = _cli("gc", url)
    if code != 0:
        _assert_one_line_error(code, out, err, f"{what}: gc")
        assert _objects_listed(url, root) == before, (what, "gc failed but deleted")
    else:
        after = _trusted(url)
        assert max(after, default=None) == max(trusted_before, default=None), (what, "gc changed the newest version")
        if newest is not None:  # what was readable before gc still is
            dest = scratch / "after-gc"
            assert _check_pulled(*_cli("pull", url, str(dest)), dest, url, states, f"{what}: pull after gc") == newest

    ckpt = scratch / "ckpt.safetensors"
    save_file(states["next"], str(ckpt))
    code, out, err = _cli("push", str(ckpt), url, "--step", "9")
    if code != 0:
        _assert_one_line_error(code, out, err, f"{what}: push")
    else:  # a push that says it published must be what readers see
        m = re.search(r"pushed version (\d+)", out)
        assert m and int(m[1]) == 9, (what, out)
        newest_rec = Run(url).newest()
        assert newest_rec is not None and newest_rec.version == 9, (what, "push reported a version readers do not see")
        assert newest_rec.state_digest == state_digest(tensor_digests(states["next"]))
    _check_follower(url, {**states, state_digest(tensor_digests(states["next"])): states["next"]}, f"{what} after push")


@pytest.mark.slow
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
    derandomize=True,
)
@given(damages=st.lists(_damage, min_size=1, max_size=3))
def test_any_damage_gives_a_one_line_error_or_a_committed_version_bit_exact(template, damages):
    root, states = template
    with tempfile.TemporaryDirectory(prefix="sparsesync-hostile-") as tmp:
        run = Path(tmp) / "run"
        shutil.copytree(root, run, symlinks=True)
        for d in damages:
            _apply(run, d)
        scratch = Path(tmp) / "out"
        scratch.mkdir()
        with _memory_bound(MEMORY_HEADROOM):
            _exercise(run, states, scratch, repr(damages)[:300])


def test_the_undamaged_run_passes_every_check(template, tmp_path):
    """The harness itself: on the intact run every command succeeds (so the property is not vacuous)."""
    root, states = template
    run = tmp_path / "run"
    shutil.copytree(root, run)
    for args in (["log", str(run)], ["verify", str(run)], ["gc", str(run), "--dry-run"]):
        assert _cli(*args)[0] == 0, args
    assert _check_pulled(*_cli("pull", str(run), str(tmp_path / "o")), tmp_path / "o", str(run), states, "intact")
    _exercise(run, states, tmp_path, "intact")
    assert Run(str(run)).newest().version == 9


# -- each class of the issue, one case at a time ----------------------------------------------------
def _copy(template: tuple, tmp_path: Path) -> tuple[Path, dict]:
    root, states = template
    run = tmp_path / "run"
    shutil.copytree(root, run)
    return run, states


def _listing(run: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(run)), p.lstat().st_size) for p in run.rglob("*"))


def _record(run: Path, version: int) -> dict:
    return json.loads(next((run / "commits").glob(f"v{version:010d}-*.json")).read_text())


def test_forward_and_cyclic_chains_are_not_commits_and_cannot_loop(template, tmp_path):
    run, states = _copy(template, tmp_path)
    # 6 (an anchor) -> 5 -> 6 -> ... never reaches the newest, 7: before, readers looped until out of memory
    for v, base, src in ((5, 6, 4), (6, 5, 3), (7, 4, 4)):
        rec = {**_record(run, src), "version": v, "base_version": base}
        (run / commit_key(v, 1)).write_text(json.dumps(rec))
    with _memory_bound(MEMORY_HEADROOM):
        code, out, err = _cli("log", str(run))
        assert code == 0 and "4 committed" in out and "base_version 6 is not below version 5" in err, (out, err)
        assert _check_pulled(*_cli("pull", str(run), str(tmp_path / "o")), tmp_path / "o", str(run), states, "cycle")
        assert _cli("gc", str(run), "--dry-run")[0] == 0
        _check_follower(str(run), states, "cycle")
        code, out, _ = _cli("verify", str(run))
        assert code == 1 and out.count("NOT A COMMIT") == 3
        # the planner itself moves strictly forward, even over records no parser would let through
        recs = [CommitRecord.from_json(json.dumps(_record(run, v)).encode(), commit_key(v, 1)) for v in (2, 3, 4)]
        recs[1].base_version, recs[2].base_version = 4, 3  # 4 -> 3 -> 4 -> ...
        with _time_bound(COMMAND_S, "Run.chain"):
            assert Run.chain(4, 5, recs, set()) is None


def test_push_into_a_run_copied_without_writers_is_seen_by_readers(template, tmp_path):
    run, states = _copy(template, tmp_path)
    (run / "commits" / "v0000000004-e000001.json").rename(run / "commits" / "v0000000004-e000003.json")
    rec = _record(run, 4)
    rec["epoch"] = 3
    (run / "commits" / "v0000000004-e000003.json").write_text(json.dumps(rec))
    shutil.rmtree(run / "writers")  # copied without writers/: the newest commit is of epoch 3
    save_file(states["next"], str(tmp_path / "c.safetensors"))
    code, out, err = _cli("push", str(tmp_path / "c.safetensors"), str(run))
    assert code == 0 and "pushed version 5" in out, (out, err)
    assert Run(str(run)).newest().version == 5  # before: epoch 1 took it, overruled by epoch 3; readers saw 4


@pytest.mark.parametrize("case", ["step 10^10", "epoch 10^6"])
def test_out_of_range_versions_and_epochs_are_refused_before_any_upload(template, tmp_path, case):
    run, states = _copy(template, tmp_path)
    save_file(states["next"], str(tmp_path / "c.safetensors"))
    args = ["push", str(tmp_path / "c.safetensors"), str(run)]
    if case == "step 10^10":
        args += ["--step", str(10**10)]
    else:
        (run / "writers" / "e999999.lock").write_bytes(b"someone")
    before = _listing(run)
    code, out, err = _cli(*args)
    _assert_one_line_error(code, out, err, case)
    assert _listing(run) == before  # nothing uploaded, no claim, no commit


def test_a_commit_overruled_while_it_was_written_fails_the_push_loudly(template, tmp_path):
    """A newer writer's commit lands between our fence check and our commit: readers will not
    see ours, so the publisher must say so (non-zero, the version readers see) instead of 'pushed'."""
    from sparsesync.errors import FencedWriterError
    from sparsesync.store.local import LocalStore

    run, states = _copy(template, tmp_path)

    class RacedStore(LocalStore):  # the other writer: it commits version 4 again, as epoch 7
        def put(self, key, data):  # type: ignore[no-untyped-def]
            if key.startswith("commits/") and not (run / commit_key(4, 7)).exists():
                rec = {**_record(run, 4), "epoch": 7}
                super().put(commit_key(4, 7), json.dumps(rec).encode())
            super().put(key, data)

    pub = Publisher(RacedStore(run), queue_size=1)
    _rec, base, _ = Run(str(run)).reconstruct()
    pub.resume(base)
    pub.publish(states["next"], 5)
    with pytest.raises(
        FencedWriterError, match=r"version 5 \(epoch 2\) was written .* readers see version 4 \(epoch 7\)"
    ):
        pub.flush()
    pub.close()
    assert Run(str(run)).newest().version == 4


def test_a_commit_replaced_by_a_writer_of_the_same_epoch_fails_the_push_loudly(template, tmp_path):
    """Without create-only writes two writers may claim one epoch; if the other one's commit of
    the same version lands on ours, readers see its weights: the push must not report success."""
    from sparsesync.errors import FencedWriterError
    from sparsesync.store.local import LocalStore

    run, states = _copy(template, tmp_path)

    class SameEpochStore(LocalStore):
        def put(self, key, data):  # type: ignore[no-untyped-def]
            super().put(key, data)
            if key.startswith("commits/"):  # the twin writer's record of the same version and epoch
                rec = json.loads(data)
                super().put(
                    key, json.dumps({**rec, "writer": "twin", "state_digest": _record(run, 4)["state_digest"]}).encode()
                )

    pub = Publisher(SameEpochStore(run), queue_size=1)
    _rec, base, _ = Run(str(run)).reconstruct()
    pub.resume(base)
    pub.publish(states["next"], 5)
    with pytest.raises(FencedWriterError, match="replaced by writer 'twin' of the same epoch"):
        pub.flush()
    pub.close()


def test_follower_reloads_when_its_version_is_overruled_with_other_weights(template, tmp_path):
    run, states = _copy(template, tmp_path)
    follower = Follower(str(run))
    assert follower.sync_once() == 4
    # a newer writer (epoch 2) re-commits version 4 with other weights, on a copy without our v4
    other = tmp_path / "other"
    shutil.copytree(run, other)
    (other / commit_key(4, 1)).unlink()
    with Publisher(str(other), writer="w2") as pub:
        _rec, base, _ = Run(str(other)).reconstruct()
        pub.resume(base)
        pub.publish(states["next"], 4)
    for p in other.rglob("*e000002*"):
        if p.is_file():
            dest = run / p.relative_to(other)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(p, dest)
    assert Run(str(run)).newest().epoch == 2
    assert follower.sync_once() == 4
    assert_bit_equal(follower.mirror, states["next"])  # before: it kept serving epoch 1's weights


def test_gc_refuses_when_the_newest_version_would_not_rebuild(template, tmp_path):
    run, states = _copy(template, tmp_path)
    with Publisher(str(run), writer="w2") as pub:  # a new writer starts with an anchor-only version 5
        pub.publish(states["next"], 5)
    shutil.rmtree(next((run / "anchors").glob("v0000000005-*")))
    before = _listing(run)
    code, out, err = _cli("gc", str(run))
    _assert_one_line_error(code, out, err, "gc")
    assert "version 5 cannot be rebuilt" in err and _listing(run) == before
    dest = tmp_path / "v4"
    assert _check_pulled(*_cli("pull", str(run), str(dest), "--version", "4"), dest, str(run), states, "v4")


@pytest.mark.parametrize(
    "what,how",
    [
        ("commit", "zero-link"),
        ("commit", "fifo"),
        ("commit", "huge"),
        ("delta", "zero-link"),
        ("delta", "fifo"),
        ("delta", "huge"),
        ("anchor", "zero-link"),
    ],
)
def test_special_and_huge_files_are_bounded(template, tmp_path, what, how):
    run, states = _copy(template, tmp_path)
    target = {"commit": lambda: run / commit_key(4, 1),
              "delta": lambda: next((run / "deltas").glob("v0000000003-v0000000004-*")),
              "anchor": lambda: next((run / "anchors").glob("v0000000003-*/model.safetensors"))}[what]()
    target.unlink()
    if how == "zero-link":
        target.symlink_to("/dev/zero")
    elif how == "fifo":
        os.mkfifo(target)
    else:
        target.write_bytes(b"{")
        os.truncate(target, 3 << 30)
    with _memory_bound(MEMORY_HEADROOM):
        for args in (["log", str(run)], ["gc", str(run), "--dry-run"], ["verify", str(run)]):
            code, out, err = _cli(*args)
            assert "Traceback" not in out + err and code in (0, 1), (args, err)
        _check_pulled(*_cli("pull", str(run), str(tmp_path / "o")), tmp_path / "o", str(run), states, f"{what} {how}")
        _check_follower(str(run), states, f"{what} {how}")


@pytest.mark.parametrize("body,reason", [
    (b"[1, 2]", "a JSON array"), (b'"v4"', "str"), (b"null", "NoneType"), (b"4", "int"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    (None, "metrics.density is str"),
])
def test_malformed_commit_records_are_one_line_reasons(template, tmp_path, body, reason):
    run, states = _copy(template, tmp_path)
    if body is None:  # non-numeric metrics
        rec = _record(run, 4)
        rec["metrics"]["density"] = "a lot"
        body = json.dumps(rec).encode()
    (run / commit_key(4, 1)).write_bytes(body)
    code, out, err = _cli("log", str(run))
    assert code == 0 and "3 committed" in out and reason in err and "Traceback" not in err, (out, err)
    code, out, err = _cli("verify", str(run))
    assert code == 1 and "NOT A COMMIT" in out and reason in out, out
    _check_pulled(*_cli("pull", str(run), str(tmp_path / "o")), tmp_path / "o", str(run), states, reason)


@pytest.mark.parametrize("field", ["created_at", "metrics.density"])
def test_a_number_too_large_for_a_float_is_not_a_commit(template, tmp_path, field):
    """An integer too large for a float (JSON has them) where a commit record wants a number is not
    a commit, with a one-line reason naming the field (before: OverflowError out of every reader)."""
    run, states = _copy(template, tmp_path)
    rec = _record(run, 4)
    if field == "created_at":
        rec["created_at"] = 10**400
    else:
        rec["metrics"]["density"] = 10**400
    (run / commit_key(4, 1)).write_bytes(json.dumps(rec).encode())
    code, out, err = _cli("log", str(run))
    assert code == 0 and "3 committed" in out and "Traceback" not in err, (out, err)
    assert f"{field} is a number too large for a float" in err, err
    _check_follower(str(run), states, field)


def test_pull_failures_are_one_line_and_leave_dest_as_it_was(template, tmp_path):
    run, states = _copy(template, tmp_path)
    # a folder nobody (root included) may create files in
    code, out, err = _cli("pull", str(run), "/sys/model.safetensors")
    _assert_one_line_error(code, out, err, "pull into /sys")
    # a full disk: the file size limit makes every write past 64 KiB fail (EFBIG), as ENOSPC does
    dest = tmp_path / "full"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
              "from sparsesync.cli import main; sys.argv = ['sparsesync', 'pull', sys.argv[1], sys.argv[2]]; main()")
    p = subprocess.run([sys.executable, "-c", script, str(run), str(dest)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    _assert_one_line_error(p.returncode, p.stdout, p.stderr, "pull onto a full disk")
    assert "free disk space" in p.stderr
    assert sorted(x.name for x in dest.iterdir()) == ["config.json"]  # no half-written file, no staging left


def test_pull_removes_model_files_that_would_shadow_the_result(template, tmp_path):
    run, states = _copy(template, tmp_path)
    dest = tmp_path / "model"
    dest.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_file({"stale": torch.zeros(2)}, str(dest / name))
    (dest / "model.safetensors.index.json").write_text('{"weight_map": {"stale": "model-00001-of-00002.safetensors"}}')
    (dest / "config.json").write_text("{}")
    assert _check_pulled(*_cli("pull", str(run), str(dest)), dest, str(run), states, "stale")
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]


def test_credentials_in_urls_are_never_printed(tmp_path, monkeypatch, caplog):
    code, out, err = _cli("log", "s3://bucket/run?endpoint=http://user:hunter22@127.0.0.1:9")
    _assert_one_line_error(code, out, err, "s3 endpoint with userinfo")
    assert "hunter22" not in out + err
    # the endpoint from the environment (not refusable from the URL): retries and the final error
    monkeypatch.setenv("SPARSESYNC_S3_ENDPOINT", "http://user:hunter22@127.0.0.1:9")
    monkeypatch.setenv("SPARSESYNC_STORE_RETRY_TRIES", "2")
    monkeypatch.setenv("SPARSESYNC_STORE_RETRY_S", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-secret")
    with caplog.at_level("WARNING"):
        code, out, err = _cli("log", "s3://bucket/run")
    _assert_one_line_error(code, out, err, "s3 unreachable")
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "retry" in logged and "hunter22" not in logged + out + err and "secret-secret" not in logged + err


# -- the same property on the S3 and HF stand-in stores --------------------------------------------
_remote_examples = iter(range(10**6))


def _upload(root: Path, url: str) -> Store:
    store = open_store(url)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            store.put(str(p.relative_to(root)), p.read_bytes())
    return store


def _damage_store(store: Store, damage: tuple) -> None:
    """`_apply`'s damage, through the store's own API (what a remote bucket allows: no FIFOs or
    links, so those become deletions; "huge" becomes a record one byte over the commit cap)."""
    if damage[0] == "commit":
        _, version, epoch, kind, spec, _ = damage
        if kind == "raw":
            store.put(commit_key(version, epoch), spec)
            return
        src, changes, base, metric = spec
        records = []
        for o in store.list("commits/"):
            with contextlib.suppress(ValueError, RecursionError):
                if o.size < 1 << 20 and isinstance(rec := json.loads(store.get(o.key)), dict):
                    records.append(rec)
        rec = {**(records[src % len(records)] if records else {}), "version": version, "epoch": epoch}
        if kind == "edited":
            rec["base_version"] = base
            if metric is not None:
                rec.setdefault("metrics", {})["density"] = metric
            rec.update(changes)
        store.put(commit_key(version, epoch), json.dumps(rec).encode())
        return
    _, i, how = damage
    prefix_ok = (
        (lambda k: not k.startswith(("commits/", "writers/")))
        if damage[0] == "object"
        else (lambda k: k.startswith("commits/"))
    )
    keys = sorted(o.key for o in store.list("") if prefix_ok(o.key))
    if not keys:
        return
    key = keys[i % len(keys)]
    data = store.get(key)
    if how in ("delete", "zero-link", "fifo", "folder"):
        store.delete([key])
    elif how == "truncate":
        store.put(key, data[: len(data) // 2])
    elif how == "flip":
        b = bytearray(data)
        b[len(b) // 2] ^= 0x40
        store.put(key, bytes(b))
    elif how == "append":
        store.put(key, data + b"\0" * 16)
    elif how == "huge":
        store.put(key, b"{" + b" " * (64 << 20))


@pytest.mark.slow
@pytest.mark.parametrize("store_backend", ["s3", "hf"], indirect=True)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow], database=None, derandomize=True)
@given(damages=st.lists(_damage, min_size=1, max_size=2))
def test_any_damage_on_a_remote_store_gives_a_one_line_error_or_a_committed_version_bit_exact(
        template, store_url, damages):
    root, states = template
    url = f"{store_url}/ex{next(_remote_examples)}"
    store = _upload(root, url)
    for d in damages:
        _damage_store(store, d)
    with tempfile.TemporaryDirectory(prefix="sparsesync-hostile-") as tmp:
        _exercise(url, states, Path(tmp), repr(damages)[:300])


@pytest.mark.parametrize("store_backend", ["s3", "hf"], indirect=True)
def test_the_undamaged_run_passes_every_check_on_a_remote_store(template, store_url, tmp_path):
    root, states = template
    _upload(root, store_url)
    _exercise(store_url, states, tmp_path, "intact")
    assert Run(store_url).newest().version == 9


# -- commit records that would cost unbounded work -------------------------------------------------
def _commit_of(run: Path, version: int) -> Path:
    return next((run / "commits").glob(f"v{version:010d}-*.json"))


def test_a_commit_of_200000_units_is_read_in_bounded_time(template, tmp_path):
    """A version in parts whose list holds 200,000 row ranges of one tensor (the schema allows
    1,000,000): every reader answers within the time bound (before: hours, a pairwise overlap check)."""
    run, states = _copy(template, tmp_path)
    rec4 = _record(run, 4)
    units = [["t", i, i + 1] for i in range(200_000)]
    parts = [{"key": f"deltas/v{4:010d}-v{5:010d}-e000001-0123abcd-p{p:05d}.safetensors", "size": 100, "xxh3": "0" * 16,
              "base_state_digest": "0" * 16, "state_digest": "0" * 16, "units": units[p * 2000:(p + 1) * 2000]}
             for p in range(100)]
    rec = {**rec4, "format": "sparsesync-commit/2", "version": 5, "base_version": 4,
           "base_state_digest": rec4["state_digest"], "delta": None, "anchor": [], "parts": parts}
    (run / commit_key(5, 1)).write_text(json.dumps(rec))
    url = str(run)
    with _memory_bound(MEMORY_HEADROOM):
        code, out, err = _cli("log", url)
        assert code == 0 and "5 committed" in out, (out, err)
        code, out, err = _cli("status", url, "--json")
        assert code == 3 and json.loads(out)["newest_version"] == 5  # no replica: unhealthy, but answered
        dest = tmp_path / "v4"
        assert _check_pulled(*_cli("pull", url, str(dest), "--version", "4"), dest, url, states, "v4")
        code, out, err = _cli("pull", url, str(tmp_path / "v5"))
        _assert_one_line_error(code, out, err, "pull of the 200,000-unit version")
        _check_follower(url, states, "200,000 units")


@pytest.mark.parametrize("size", [1 << 50, 1 << 39], ids=["1PiB-beyond-the-schema", "512GiB-within-it"])
def test_a_size_field_far_beyond_the_object_never_sizes_an_allocation(template, tmp_path, size):
    """A commit record claims its delta has `size` bytes: beyond any real object (1 PiB) it is not a
    commit, with a one-line reason naming the record and the field; a size the schema allows is
    read as what the object really holds, and fails its check in one line (before: MemoryError)."""
    run, states = _copy(template, tmp_path)
    path = _commit_of(run, 4)
    rec = json.loads(path.read_text())
    rec["delta"]["size"] = size
    path.write_text(json.dumps(rec))
    url = str(run)
    with _memory_bound(MEMORY_HEADROOM):
        code, out, err = _cli("log", url)
        assert code == 0 and "Traceback" not in err
        if size > 1 << 40:
            assert path.name in err and "size" in err and "outside" in err, err
        code, out, err = _cli("pull", url, str(tmp_path / "o"))
        if size > 1 << 40:  # version 4 is not a commit: the newest is 3
            assert _check_pulled(code, out, err, tmp_path / "o", url, states, "1 PiB") and "version 3" in out
        else:
            _assert_one_line_error(code, out, err, "pull of a delta that claims 512 GiB")
            assert "MemoryError" not in err and "bytes" in err
        _check_follower(url, states, f"size {size}")


# -- fleet records: heartbeats and switch records are data -----------------------------------------
_NUMBERS = st.one_of(st.sampled_from([10**400, -(10**400), 2**63, float("nan"), float("inf"), float("-inf"), -1, -1e-9,
                                      1e300, 0, 3e10, 1e11]), st.floats(), st.integers(-10**12, 10**12))
_TEXTS = st.one_of(st.text(max_size=10), st.sampled_from([
    "[/x]", "[link=https://evil.example]click[/link]", "\x1b[2J\x1b]8;;https://evil.example\x07x\x1b]8;;\x07",
    "[bold red]", "\u202eevil", "a\nb\rc", "x" * 301, "]["]))
_FLEET_VALUES = st.one_of(_NUMBERS, _TEXTS, st.none(), st.booleans(), st.lists(st.integers(), max_size=2),
                          st.dictionaries(_TEXTS, _TEXTS, max_size=2))
_HEARTBEAT_FIELDS = ["written_at", "interval_s", "health", "version", "state_digest", "newest_version", "lag",
                     "last_apply_at", "last_apply_s", "last_error", "engine", "where", "coordinated", "switch_poll_s",
                     "staged_version", "staged_at", "last_switch", "versions_applied", "seq", "retry_at", "replica"]
_SWITCH_FIELDS = ["version", "apply_at", "written_at", "by", "format"]
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e]")  # what a record's kept text never holds
_fleet_record = st.tuples(
    st.sampled_from(["heartbeat", "switch"]), st.integers(0, 3),
    st.dictionaries(st.sampled_from(_HEARTBEAT_FIELDS + _SWITCH_FIELDS), _FLEET_VALUES, min_size=1, max_size=3))


def _fleet_body(kind: str, n: int, changes: dict) -> tuple[str, bytes]:
    from sparsesync.protocol.keys import heartbeat_key, switch_key
    from sparsesync.protocol.records import Heartbeat, SwitchRecord

    if kind == "heartbeat":
        rec: dict = json.loads(Heartbeat(replica=f"h{n}", written_at=time.time(), interval_s=1.0, health="following",
                                         version=4, state_digest="ab", newest_version=4, lag=0, last_apply_at=None,
                                         last_apply_s=None, last_error=None).to_json())
        key = heartbeat_key(f"h{n}")
    else:
        rec = json.loads(SwitchRecord(version=n, apply_at=time.time(), written_at=time.time(), by="x").to_json())
        key = switch_key(n)
    rec.update((k, v) for k, v in changes.items() if kind == "heartbeat" or k in _SWITCH_FIELDS)
    return key, json.dumps(rec).encode()


@pytest.fixture
def fleet_run(template, store_url) -> Iterator[tuple[str, Store]]:
    """The template run uploaded to this test's store (the test writes the fleet records)."""
    root, _ = template
    store = _upload(root, store_url)
    yield store_url, store


@pytest.mark.parametrize("store_backend", ["local", "s3"], indirect=True)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
    derandomize=True,
)
@given(records=st.lists(_fleet_record, min_size=1, max_size=3))
def test_any_fleet_record_is_read_as_data(fleet_run, records):
    """Whatever heartbeats and switch records hold, no reader raises, every record kept has its
    numbers in range and no control characters, a record from the future is not live, and
    `sparsesync status` prints it as text (no markup, no escape sequence)."""
    from sparsesync.errors import FleetTimeoutError
    from sparsesync.protocol.fleet import EXPIRY_GRACE_S, read_fleet, read_switch, switch_lead_s, wait_for_fleet
    from sparsesync.protocol.keys import FLEET, SWITCHES, heartbeat_key
    from sparsesync.protocol.records import Heartbeat

    max_time = 1e11  # the year 5138: no record's time is later

    url, store = fleet_run
    old = [o.key for o in [*store.list(FLEET), *store.list(SWITCHES)]]
    if old:
        store.delete(old)
    ok = Heartbeat(replica="ok", written_at=time.time(), interval_s=30.0, health="following", version=4,
                   state_digest="ab", newest_version=4, lag=0, last_apply_at=None, last_apply_s=None, last_error=None)
    store.put(heartbeat_key("ok"), ok.to_json())
    for kind, n, changes in records:
        store.put(*_fleet_body(kind, n, changes))
    with _time_bound(COMMAND_S, "fleet readers"):
        view = read_fleet(store)
        for seen in view.replicas:
            r = seen.record
            for name in ("written_at", "last_apply_at", "staged_at", "retry_at"):
                v = getattr(r, name)
                assert v is None or (math.isfinite(v) and 0 <= v < max_time), (name, v)
            for name in ("interval_s", "switch_poll_s", "last_apply_s"):
                v = getattr(r, name)
                assert v is None or (math.isfinite(v) and v >= 0), (name, v)
            for text in (r.health, r.engine, r.last_error or "", r.state_digest or "", *r.where, *r.where.values()):
                assert not _CONTROL.search(text), text
            if seen.live:
                assert seen.age_s >= -EXPIRY_GRACE_S
        assert "ok" in [s.record.replica for s in view.live]
        for n in range(4):
            sw = read_switch(store, n)
            assert sw is None or (math.isfinite(sw.apply_at) and 0 <= sw.apply_at < max_time)
        assert 0 <= switch_lead_s(view) <= 10
        assert wait_for_fleet(store, 4, 1, timeout=0.2)
        with pytest.raises(FleetTimeoutError):
            wait_for_fleet(store, 5, 1, timeout=0.2)
    for args in (["status", url], ["status", url, "--json"], ["status", url, "--all"]):
        code, out, err = _cli(*args)
        assert code in (0, 3) and "Traceback" not in out + err, (args, code, out, err)
        assert not _CONTROL.search(out + err.replace("\n", "")), (args, out)  # no escape sequence reaches a terminal
        if "--json" in args:
            json.loads(out)


# -- buggy but self-consistent writers: every object matches its record, the weights do not ----------
def _forge_delta_4(run: Path, lie: str) -> dict[str, torch.Tensor]:
    """Replace version 4's delta (3 -> 4) with a patch a buggy writer could have made: its streams
    decode cleanly against version 3 but give other weights (one element off in each tensor the
    real delta touches), and the commit record is rewritten so the object's size and xxh3 match it.
    `lie` says which digest the writer got wrong: "tensor-digests" keeps the true version 4's
    per-tensor and state digests in the patch (the decoded bits match neither); "state-digest"
    records the wrong weights' own per-tensor digests in the patch, so only the state digest
    (the commit's and the patch's) still names version 4. Returns the wrong weights."""
    url = str(run)
    _, v3, _ = Run(url).reconstruct(3)
    rec4, v4, _ = Run(url).reconstruct(4)
    wrong = {k: t.clone() for k, t in v4.items()}
    touched = [n for n, ch in diff_state(v3, v4).items() if ch.indices.size]
    for n in touched:
        flat = wrong[n].view(-1)
        flat[0] = flat[0] + 1 if flat[0] != 0 else 1.0  # another bf16 value, still finite
    changes = diff_state(v3, wrong)
    d3, d4, dw = tensor_digests(v3), tensor_digests(v4), tensor_digests(wrong)
    target = d4 if lie == "tensor-digests" else dw
    body = encode_changes(changes, base_version=3, target_version=4, base_digests=d3, target_digests=target,
                          base_state_digest=state_digest(d3), target_state_digest=rec4.state_digest, base=v3)
    rec = _record(run, 4)
    (run / rec["delta"]["key"]).write_bytes(body)
    rec["delta"].update(size=len(body), xxh3=bytes_digest(body))
    _commit_of(run, 4).write_text(json.dumps(rec))
    assert state_digest(dw) != rec4.state_digest
    return wrong


@pytest.mark.parametrize("lie", ["tensor-digests", "state-digest"])
def test_a_buggy_writer_whose_objects_match_their_records_is_caught_by_the_target_digests(template, tmp_path, lie):
    """Size and xxh3 of every object match the commit, every stream decodes: only the target
    digests (per tensor, or the state digest) tell the weights are not version 4's. Every reader
    refuses version 4 in one line, and no reader ever holds the wrong weights as a version."""
    run, states = _copy(template, tmp_path)
    wrong = _forge_delta_4(run, lie)
    url = str(run)
    with pytest.raises(SparsesyncError, match=r"3->4|version 4"):
        Run(url).reconstruct(4)
    code, out, err = _cli("pull", url, str(tmp_path / "v4"), "--version", "4")
    _assert_one_line_error(code, out, err, f"{lie}: pull 4")
    assert not (tmp_path / "v4").exists()
    follower = Follower(url)
    try:
        served = follower.sync_once()
        st = follower.status()
        assert served == 3 and st.state == "degraded" and "\n" not in (st.last_error or "x\n"), st
        assert_bit_equal(follower.mirror, states[state_digest(follower.digests)])
        assert state_digest(tensor_digests(follower.mirror)) != state_digest(tensor_digests(wrong))
    finally:
        follower.stop()
    code, out, _ = _cli("verify", url)
    assert code == 1 and "4" in out
    _exercise(run, states, tmp_path / "scratch", f"buggy writer ({lie})")


def test_a_record_under_another_versions_name_is_not_a_commit(template, tmp_path):
    """Version 3's record copied to version 5's name: the name and the body disagree, so it is not
    a commit (readers would otherwise plan from a record whose name they trusted for ordering)."""
    run, states = _copy(template, tmp_path)
    (run / commit_key(5, 1)).write_text(json.dumps(_record(run, 3)))
    code, out, err = _cli("log", str(run))
    assert code == 0 and "4 committed" in out and "does not match its name" in err, (out, err)
    assert max(_trusted(str(run))) == 4
    _check_follower(str(run), states, "renamed record")


def test_an_object_other_than_the_one_its_commit_names_is_refused_before_it_is_parsed(template, tmp_path):
    """Version 4's delta replaced by the same patch with its safetensors header padded by 8 more
    spaces (a valid file that gives the very same weights, other bytes): readers refuse it on its
    size and xxh3, before parsing it, and say so."""
    run, states = _copy(template, tmp_path)
    url = str(run)
    delta = run / _record(run, 4)["delta"]["key"]
    data = delta.read_bytes()
    n = int.from_bytes(data[:8], "little")
    delta.write_bytes((n + 8).to_bytes(8, "little") + data[8:8 + n] + b" " * 8 + data[8 + n:])
    patch = read_patch(delta.read_bytes())  # still a valid patch
    assert patch.header.target_version == 4
    code, out, err = _cli("pull", url, str(tmp_path / "v4"), "--version", "4")
    _assert_one_line_error(code, out, err, "pull 4")
    assert "expected" in err and "bytes with digest" in err, err
    _exercise(run, states, tmp_path / "scratch", "an object other than the recorded one")


def test_an_anchor_that_holds_another_versions_weights_is_refused(template, tmp_path):
    """A buggy writer stores version 2's weights as version 3's anchor, self-consistent (the file's
    own digests match its tensors; the commit's size and xxh3 match the file): only the anchor's
    state digest against the commit tells, and readers never take those weights as version 3."""
    run, states = _copy(template, tmp_path)
    url = str(run)
    _, v2, _ = Run(url).reconstruct(2)
    rec = _record(run, 3)
    (ref,) = rec["anchor"]
    path = run / ref["key"]
    write_anchor_shard(v2, path, version=3, alone=True)
    ref.update(size=path.stat().st_size, xxh3=file_digest(path))
    _commit_of(run, 3).write_text(json.dumps(rec))
    commit3 = Run(url).commit(3)
    with pytest.raises(SparsesyncError, match="expected " + commit3.state_digest):
        Run(url).fetch_anchor(commit3)
    _exercise(run, states, tmp_path / "scratch", "an anchor of other weights")
