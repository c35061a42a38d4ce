"""A folder on the local disk as an object store: the embedded default.

Guarantees: a reader never sees a half-written object (every write goes to a hidden temp
file in the same folder, is fsynced, then renamed into place); `put_new` is a real
create-only write (`os.link` of the finished temp file fails if the key exists), so
`has_create_only` is True; keys are validated so no key can escape the root. Within
`deferred_sync()` a write is renamed into place before its fsync, which then runs in the
background (`_later_sync`); every later write, delete and `close` first waits for it, so an
object is durable before any later one becomes visible, and after a power loss only the newest
deferred object can be missing or empty (the commit record, whose loss leaves the version
uncommitted). Temp files
(`.sparsesync-tmp-*`) are never listed. Only regular files are objects: anything else under
the root (a FIFO, a device, a symlink to one such as /dev/zero) is never listed, and reading it
raises `ObjectNotFoundError` at once (it is opened non-blocking and checked before any byte is read), so
a hostile folder can neither hang a reader nor feed it endless bytes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from sparsesync.errors import ObjectNotFoundError, StoreAuthError, StoreError
from sparsesync.store import retry
from sparsesync.store._keys import check_key, check_prefix
from sparsesync.store._later_sync import LaterSync
from sparsesync.store.base import ObjectInfo, Store

_TMP = ".sparsesync-tmp-"
_CHUNK = 1 << 20


def _copy_stream(src: io.BufferedIOBase, dst: BinaryIO) -> None:
    """Copy `src` to `dst` through one reused buffer of `_CHUNK` bytes (memory bounded by that,
    not by the object: a model-sized anchor costs 1 MiB, not two blocks of 8)."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while n := src.readinto(buf):
        dst.write(view[:n])


class LocalStore(Store):
    """Objects are files under `root`; the key is the path relative to it."""

    has_create_only = True

    def __init__(self, root: str | Path, *, url: str | None = None, create: bool = False) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = url or str(self.root)
        self._later = LaterSync()  # the fsync of the last write made in `deferred_sync`, if any
        self._deferring = threading.local()
        if create:
            self._call("create", self.url, lambda: self.root.mkdir(parents=True, exist_ok=True))
        elif self.root.exists() and not self.root.is_dir():
            raise StoreError(f"{self.url} is a file, not a folder", url=self.url,
                             hint="point the store at a folder")

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    # -- helpers ------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root / check_key(key, self.url)

    def _translate(self, e: Exception, what: str, url: str) -> StoreError | None:
        if isinstance(e, FileNotFoundError):
            return ObjectNotFoundError(f"no object at {url}", url=url,
                                       hint="check the key; the writer may not have committed it yet")
        if isinstance(e, PermissionError):
            return StoreAuthError(f"permission denied for {what} of {url}", url=url,
                                  hint=f"give this user read/write access to {self.root}")
        if isinstance(e, NotADirectoryError):  # a parent of the key is an object, so the key cannot exist
            return ObjectNotFoundError(f"no object at {url}", url=url, hint="check the key")
        if isinstance(e, IsADirectoryError):
            return ObjectNotFoundError(f"{url} is a folder, not an object", url=url,
                                       hint="name a file key, or list() the prefix")
        if isinstance(e, OSError):
            return StoreError(f"{what} of {url} failed: {retry.describe(e)}", url=url,
                              hint="check free disk space and that the folder is writable")
        return None

    @contextlib.contextmanager
    def deferred_sync(self) -> Iterator[None]:
        """This thread's writes in the block are visible before they are durable: each is
        fsynced in the background, and the next write, delete or `close` waits for that first."""
        self._deferring.on = True
        try:
            yield
        finally:
            self._deferring.on = False

    def _settle(self, url: str) -> None:
        """Wait for the deferred fsync of the last write (so it is durable before anything after it)."""
        try:
            self._later.settle()
        except OSError as e:
            raise StoreError(f"{url} was not written: the write before it, {e.filename}, could not be made "
                             f"durable ({e.strerror})", url=url,
                             hint="check the disk (I/O errors, free space): that object may be lost after a "
                             "power failure") from e

    def close(self) -> None:
        """Wait until the last deferred write is durable."""
        self._settle(self.url)

    def _write_temp(self, dest: Path, data: bytes | Path, *, sync: bool = True) -> Path:
        tmp = dest.with_name(f"{_TMP}{uuid.uuid4().hex}-{dest.name}")
        for attempt in range(5):
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                out = open(tmp, "xb")
                break
            except FileNotFoundError:  # a concurrent delete pruned the emptied folder: make it again
                if attempt == 4:
                    raise
        try:
            with out:
                if isinstance(data, (bytes, bytearray, memoryview)):
                    out.write(data)
                else:
                    with open(data, "rb") as src:
                        _copy_stream(src, out)
                out.flush()
                if sync:
                    os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    # -- writes -------------------------------------------------------------------------
    def put(self, key: str, data: bytes | Path) -> None:
        dest = self._path(key)
        if not isinstance(data, (bytes, bytearray, memoryview)) and not Path(data).is_file():
            raise StoreError(f"cannot upload {data} to {self.object_url(key)}: no such file",
                             url=self.object_url(key), hint="pass bytes or an existing file")

        defer = getattr(self._deferring, "on", False)

        def _put() -> None:
            self._check_no_file_in_the_way(key)
            tmp = self._write_temp(dest, data, sync=not defer)
            try:
                os.replace(tmp, dest)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

        self._settle(self.object_url(key))
        self._call("write", self.object_url(key), _put)
        if defer:
            self._later.start(dest)

    def _check_no_file_in_the_way(self, key: str) -> None:
        """A folder cannot also be a file: 'a' and 'a/b' cannot both be objects here."""
        parts = key.split("/")
        for i in range(1, len(parts)):
            if (self.root.joinpath(*parts[:i])).is_file():
                raise StoreError(f"cannot write {self.object_url(key)}: object {'/'.join(parts[:i])!r} exists "
                                 "where a folder is needed", url=self.object_url(key),
                                 hint="on a local store a key cannot be both an object and a folder")
        if (self.root / key).is_dir():
            raise StoreError(f"cannot write {self.object_url(key)}: it is a folder of other objects",
                             url=self.object_url(key),
                             hint="on a local store a key cannot be both an object and a folder")

    def put_new(self, key: str, data: bytes) -> bool:
        dest = self._path(key)

        def _put_new() -> bool:
            self._check_no_file_in_the_way(key)
            tmp = self._write_temp(dest, data)
            try:
                os.link(tmp, dest)  # atomic create-only: fails with EEXIST if dest exists
                return True
            except FileExistsError:
                return False
            finally:
                tmp.unlink(missing_ok=True)

        self._settle(self.object_url(key))
        return self._call("create-only write", self.object_url(key), _put_new)

    def delete(self, keys: Sequence[str]) -> None:
        paths = [self._path(k) for k in keys]

        def _delete() -> None:
            for p in paths:
                try:
                    p.unlink()
                except FileNotFoundError:
                    continue
                self._prune(p.parent)

        self._settle(self.url)
        self._call("delete", self.url, _delete)

    def _prune(self, folder: Path) -> None:
        """Remove folders left empty by a delete, up to (not including) the root."""
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    return
                raise
            folder = folder.parent

    # -- reads --------------------------------------------------------------------------
    def _open(self, key: str) -> io.BufferedReader:
        """The object's file opened for reading, refusing anything but a regular file.

        Non-blocking open, so a FIFO cannot hang us; the type is checked on the open descriptor
        (no race with a swap after a stat)."""
        fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ObjectNotFoundError(f"{self.object_url(key)} is not a regular file ({_kind(mode)})",
                                 url=self.object_url(key),
                                 hint="only regular files are objects; remove it from the run folder")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def get(self, key: str) -> bytes:
        def _read() -> bytes:
            with self._open(key) as f:
                return f.read()

        return self._call("read", self.object_url(key), _read)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise StoreError(f"bad range start={start} length={length} for {self.object_url(key)}",
                             url=self.object_url(key), hint="start and length must be >= 0")

        def _read() -> bytes:
            with self._open(key) as f:
                f.seek(start)
                return f.read(length)

        return self._call("range read", self.object_url(key), _read)

    def get_file(self, key: str, dest: Path) -> None:
        dest = Path(dest)

        def _copy() -> None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + f".part-{uuid.uuid4().hex[:8]}")
            try:
                with self._open(key) as i, open(tmp, "wb") as o:
                    _copy_stream(i, o)
                os.replace(tmp, dest)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

        self._call("download", self.object_url(key), _copy)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix, self.url)
        # walk only the deepest folder the prefix names, then filter by plain string match
        folder = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root

        def _walk() -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            if folder.is_dir():
                rel = os.path.relpath(folder, self.root)
                _scan(str(folder), "" if rel == "." else rel.replace(os.sep, "/") + "/", prefix, out)
            out.sort(key=lambda o: o.key)
            return out

        return self._call("list", self.url + ("/" + prefix if prefix else ""), _walk)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return self._call("stat", self.object_url(key), path.is_file)


def _scan(path: str, key_dir: str, prefix: str, out: list[ObjectInfo]) -> None:
    """Append the objects under folder `path` (whose keys begin `key_dir`) whose keys start
    with `prefix`: regular files and links to them, never temp files; folders are descended,
    links to folders are not (as `os.walk` does); a folder or file gone meanwhile is skipped.
    One `stat` per file, none per folder (the entry's type comes with the listing)."""
    try:
        entries = list(os.scandir(path))
    except OSError:  # deleted while we walked
        return
    for entry in entries:
        key = key_dir + entry.name
        try:
            if entry.is_dir():
                if not entry.is_symlink() and (key.startswith(prefix) or prefix.startswith(key + "/")):
                    _scan(entry.path, key + "/", prefix, out)
                continue
            if entry.name.startswith(_TMP) or not key.startswith(prefix):
                continue
            st = entry.stat()
        except OSError:  # deleted while we walked, or a dangling link
            continue
        if stat.S_ISREG(st.st_mode):  # FIFOs, devices, links to them: not objects
            out.append(ObjectInfo(key, st.st_size))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
