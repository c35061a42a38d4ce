"""Where a follower keeps its mirror: one file-backed shared map on local disk, not anonymous memory.

Guarantees:
- `MirrorDir.allocate(layout)` returns one C-contiguous tensor per name, of the layout's dtype and
  shape, each a view into a single file mapped shared (`MAP_SHARED`) from the mirror directory.
  Writes go to that file's page cache: the OS writes them back and drops the pages under memory
  pressure, so the mirror never pins the model's bytes in anonymous memory (a replica's
  anonymous memory stays bounded by what its engine needs plus the decode buffers of one
  version). Nothing is left on disk when the process ends, however it ends, and the space
  returns when the last tensor of the map is gone. A mirror file is never read back after a
  restart: the follower rebuilds it from an anchor. Its disk blocks are reserved before it is
  mapped (`posix_fallocate`): a full disk is an error at allocation (then anonymous memory, with
  a warning), never a fault while writing.
- The directory is shared ground (others may write it): the mirror file never has a name in it
  (`create_unlinked`: `O_TMPFILE | O_EXCL`, which can never be linked into a folder; on a file
  system without it, a random name created `O_CREAT | O_EXCL | O_NOFOLLOW`, unlinked by the next
  call and refused if it then still has a link) and is mapped from that descriptor, never
  reopened by path. So no process can open it through the folder, to write it or truncate it
  (which would kill this one with SIGBUS). Nothing else in the folder is opened, written or
  removed: the writability probe is such a file too. Not covered: a process that can open this
  one's `/proc/<pid>/fd/` (same user and PID namespace, ptrace read access) reaches the open file;
  a disk file cannot be sealed against truncation (`F_ADD_SEALS` is for memfd only), so it could
  still make this process's next access past the new end a SIGBUS. What it writes is caught by
  the follower's digests (`follower`: checked before every whole-mirror load).
- `MirrorDir.staged(fetch)` stages an anchor's download in the directory; when its file system is
  full (`is_full`: ENOSPC, EDQUOT, EFBIG), in the system's temp dir instead, the mirror then in
  anonymous memory, with one warning: a full disk never keeps an anchor from loading.
- Tensors start at 64-byte boundaries of the file (aligned for every dtype).
- The cost: the kernel writes dirty mirror pages back to disk (each version dirties most of
  them; the kernel writes each dirty page at most about every 30 s, more often when dirty
  memory passes its background ratio). `SPARSESYNC_MIRROR_DIR=memory` keeps the mirror in
  anonymous memory instead (no disk traffic, one more copy that cannot be paged without swap).
- The directory (`mirror_dir()`): `SPARSESYNC_MIRROR_DIR`, else `$XDG_CACHE_HOME/sparsesync/mirror`,
  else `~/.cache/sparsesync/mirror`; never `TMPDIR`, which may be tmpfs (memory). A directory on
  tmpfs or ramfs is used, with a warning (it is memory then). When the directory cannot be
  created or written, `allocate` falls back to anonymous memory, with a warning naming it.
- `drop_resident(tensors)` unmaps from this process the pages of the tensors that lie in a
  mirror's file map, once the follower or an engine is done with them: the bits stay in the
  file's page cache (the next read faults them back in, from memory while the OS keeps them), so
  the mirror costs the process's RSS only the tensors in use, not the model. The follower does it
  for hooks that ask (`pages_out_mirror`, see `hooks`: each tensor once read or written, the whole
  mirror after every sync), the vLLM backend for each layer once reloaded and read back. Mapping
  the pages back costs the next update a fault per page. Only a map `allocate` made and that is
  still alive is touched, each confirmed a shared file map in /proc/self/maps at the call:
  dropping anonymous or private pages would zero them, so any other tensor (the `memory` mirror,
  an engine's own weights) is left alone.
- `release_freed_memory()` hands the memory the C allocator keeps after frees back to the OS
  (glibc `malloc_trim(0)`; a no-op elsewhere): the follower calls it after every sync, so
  reloads leave no freed model-sized memory behind (measured: it costs the next update no
  measurable time). Within an update, the vLLM backend returns its temporaries the same way
  after each decoder layer's reload and each parameter's read-back (`integrations.vllm.backend`,
  `readback`), so they never pile up over the model: vLLM CPU's non-evictable peak during an
  update 1.50-1.55 copies of the model (92 and 368 MB), 4.0 when returned only after the update
  (benchmarks/results/replica_memory.json). A process-wide `MALLOC_MMAP_THRESHOLD_=1048576`
  does the same at 2.3x the CPU time per update (page faults), so it is not set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

ENV_DIR = "SPARSESYNC_MIRROR_DIR"
IN_MEMORY = "memory"  # the directory value that keeps the mirror in anonymous memory
ALIGN = 64
_MADV_DONTNEED = 4  # Linux; on a shared file map: unmap, the bits stay in the page cache and file
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the mirror's file system (or the process's file size limit) is full
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)  # a file system (or kernel) without O_TMPFILE
Layout = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
T = TypeVar("T")
_LIVE: dict[int, tuple[int, weakref.ref[mmap.mmap]]] = {}  # start -> (end, the map): this process's mirror maps
_LIVE_LOCK = threading.Lock()


def mirror_dir() -> Path:
    """The default mirror directory (see module docstring)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "sparsesync" / "mirror"


def create_unlinked(directory: str | Path, *, tmpfile: bool = True) -> int:
    """A read-write, close-on-exec descriptor of a new empty file in `directory` that has no name
    (see module docstring): `O_TMPFILE | O_EXCL` (never linkable into a folder), or where the file
    system lacks it (or `tmpfile` is False), a random name created with `O_CREAT | O_EXCL |
    O_NOFOLLOW` and unlinked by the next call; OSError if the file then still has a name (another
    process linked or moved it in between). Nothing existing in `directory` is opened or removed."""
    if tmpfile and hasattr(os, "O_TMPFILE"):
        try:
            return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno not in _NO_TMPFILE:
                raise
    for _ in range(8):
        path = os.path.join(directory, f".mirror-{secrets.token_hex(16)}.tmp")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            os.unlink(path)
            if os.fstat(fd).st_nlink:
                raise OSError(errno.EEXIST, f"a new mirror file in {directory} was linked or moved by another process")
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise FileExistsError(errno.EEXIST, f"no new file name in {directory}")


def is_full(e: BaseException) -> bool:
    """Whether `e` (or an error it was raised from) says a file system is full: ENOSPC, EDQUOT or
    EFBIG (a file size limit)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _FULL:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _fs_type(path: Path) -> str | None:
    """The file system type of the mount holding `path` (Linux /proc/mounts), or None."""
    try:
        best, kind = "", None
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if (
                    len(parts) > 2
                    and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/"))
                    and len(parts[1]) > len(best)
                ):
                    best, kind = parts[1], parts[2]
        return kind
    except OSError:
        return None


class MirrorDir:
    """Allocates mirrors as shared file maps in one directory (see module docstring)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else mirror_dir()
        in_memory = str(directory if directory is not None else os.environ.get(ENV_DIR, "")) == IN_MEMORY
        self._checked = in_memory  # "memory": anonymous memory, by choice (no file, no warning)
        self._usable = False
        self._full = False  # staging found the directory's file system full: this anchor's mirror goes to memory
        self._lock = threading.Lock()

    def _check(self) -> bool:
        with self._lock:
            if not self._checked:
                self._checked = True
                try:
                    self.directory.mkdir(parents=True, exist_ok=True)
                    # the probe: a new file with no name, nothing written through a name
                    os.close(create_unlinked(self.directory))
                    self._usable = True
                except OSError as e:
                    log.warning("mirror directory %s is not writable (%s): the mirror stays in anonymous memory; "
                                "set %s to a folder on local disk", self.directory, e, ENV_DIR)
                if self._usable and _fs_type(self.directory) in ("tmpfs", "ramfs"):
                    log.warning(
                        "mirror directory %s is on %s: the mirror is held in memory; set %s to a folder on disk",
                        self.directory,
                        _fs_type(self.directory),
                        ENV_DIR,
                    )
            return self._usable

    @property
    def workdir(self) -> Path | None:
        """Where downloads on their way into a mirror may go (None: the system's temp dir)."""
        return self.directory if self._check() else None

    def staged(self, fetch: Callable[[Path | None], T]) -> T:
        """`fetch(workdir)`, the downloads it stages in the mirror directory; when that file system
        is full (`is_full`), once more with the system's temp dir and the mirror in anonymous
        memory, with one warning (a full disk never keeps an anchor from loading)."""
        workdir = self.workdir
        if workdir is None:
            return fetch(None)
        try:
            return fetch(workdir)
        except Exception as e:
            if not is_full(e):
                raise
            log.warning(
                "mirror directory %s is full (%s): staging this anchor in the system's temp dir and keeping the "
                "mirror in anonymous memory; free space there or set %s",
                self.directory,
                e,
                ENV_DIR,
            )
        self._full = True
        try:
            return fetch(None)
        finally:
            self._full = False

    def allocator(
        self, *, page_out: bool
    ) -> tuple[Callable[[Layout], dict[str, torch.Tensor]], Callable[[torch.Tensor], int] | None]:
        """(`allocate`, and with `page_out` a callback that unmaps each tensor it allocated once
        called with it: for `codec.load_anchor`'s `alloc` and `written`)."""
        drop: list[Callable[[torch.Tensor], int]] = []

        def alloc(layout: Layout) -> dict[str, torch.Tensor]:
            state = self.allocate(layout)
            drop.append(pager(state.values()))
            return state

        return alloc, ((lambda t: drop[-1](t)) if page_out else None)

    def allocate(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Uninitialised tensors for `layout`, views into one shared file map (see module docstring)."""
        offsets: dict[str, int] = {}
        size = 0
        for name, (dtype, shape) in layout.items():
            offsets[name] = size
            numel = 1
            for d in shape:
                numel *= d
            size += -(-numel * torch.empty((), dtype=dtype).element_size() // ALIGN) * ALIGN
        if self._full or not self._check() or size == 0:
            return {n: torch.empty(shape, dtype=dtype) for n, (dtype, shape) in layout.items()}
        try:
            fd = create_unlinked(self.directory)  # no name in the folder, ever: nobody else opens it by path
            try:
                # blocks reserved now: a write into a mapped hole of a full disk would kill the
                # process (SIGBUS); here it is an OSError, and the mirror falls back to memory
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except (OSError, ValueError) as e:
            log.warning("cannot map a %d-byte mirror in %s (%s): using anonymous memory", size, self.directory, e)
            return {n: torch.empty(shape, dtype=dtype) for n, (dtype, shape) in layout.items()}
        storage = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()  # keeps `mm` (the map) alive
        with _LIVE_LOCK:
            for lo in [lo for lo, (_, ref) in _LIVE.items() if ref() is None]:
                del _LIVE[lo]
            _LIVE[storage.data_ptr()] = (storage.data_ptr() + size, weakref.ref(mm))
        out = {}
        for name, (dtype, shape) in layout.items():
            t = torch.empty(0, dtype=dtype)
            t.set_(storage, offsets[name] // t.element_size(), tuple(shape), _contiguous_strides(shape))
            out[name] = t
        return out


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def is_file_backed(t: torch.Tensor) -> bool:
    """Whether `t`'s memory lies in a shared file map (checked in /proc/self/maps; Linux only)."""
    addr = t.untyped_storage().data_ptr()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    return "s" in parts[1] and len(parts) == 6 and parts[5].startswith("/")
    except OSError:
        return False
    return False


def _mirror_maps() -> list[tuple[int, int]]:
    """(start, end) of every mirror map `MirrorDir.allocate` made that is still alive, each only
    if /proc/self/maps shows it as a shared map of a file."""
    with _LIVE_LOCK:
        live = [(lo, hi) for lo, (hi, ref) in _LIVE.items() if ref() is not None]
    shared: list[tuple[int, int]] = []  # consecutive shared file maps, merged
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[1][3] == "s" and parts[4] != "0":
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    if shared and shared[-1][1] == lo:
                        shared[-1] = (shared[-1][0], hi)
                    else:
                        shared.append((lo, hi))
    except OSError:
        return []
    return [(lo, hi) for lo, hi in live if any(a <= lo and hi <= b for a, b in shared)]


def pager(tensors: Iterable[torch.Tensor]) -> Callable[[torch.Tensor], int]:
    """A function that unmaps from this process the whole pages of a tensor (or a view of one)
    lying within one of `tensors` that are in a mirror's shared file map, checked now, once, in
    /proc/self/maps; it returns the bytes unmapped (see module docstring). Their bits are
    unchanged: the next access maps them again. Memory outside those tensors is never touched.
    Use it while `tensors` are alive (a mirror's tensors keep their map mapped)."""
    lib = _libc()
    maps = _mirror_maps() if lib is not None else []
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.device.type == "cpu"]
    mapped = sorted((lo, hi) for lo, hi in spans if hi > lo and any(a <= lo and hi <= b for a, b in maps))
    page = mmap.PAGESIZE

    def drop(t: torch.Tensor) -> int:
        if not mapped or lib is None or t.device.type != "cpu":
            return 0
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        if not any(a <= lo and hi <= b for a, b in mapped):
            return 0  # anonymous, private or foreign memory: MADV_DONTNEED would zero it
        start, end = -(-lo // page) * page, hi // page * page  # whole pages inside the tensor only
        if end > start and lib.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0:
            return end - start
        return 0

    return drop


def drop_resident(tensors: Iterable[torch.Tensor]) -> int:
    """`pager(tensors)` applied to each of `tensors`: the bytes unmapped from this process."""
    ts = list(tensors)
    drop = pager(ts)
    return sum(drop(t) for t in ts)


_LIBC: ctypes.CDLL | None = None
_LIBC_LOOKED = False  # whether _LIBC was looked up (None then: no glibc)


def _libc() -> ctypes.CDLL | None:
    global _LIBC, _LIBC_LOOKED
    if not _LIBC_LOOKED:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") else None
        except OSError:
            _LIBC = None
        _LIBC_LOOKED = True
    return _LIBC


def release_freed_memory() -> None:
    """Return the memory glibc keeps after frees to the OS (`malloc_trim(0)`; no-op without glibc)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
