"""Writing a pulled version into DEST (`sparsesync.transfer.pull`): all of it, or nothing.

Guarantees:
- Nothing in DEST changes until the new version is complete: it is written into a staging
  folder on DEST's own file system (a DEST that is a link is followed to the real one, so a
  rename never crosses devices), then swapped in. A failure while writing (read-only folder,
  full disk, a bad run) leaves DEST as it was.
- Into an existing folder, the swap moves the new files in (the index last) and moves every
  other `*.safetensors` and `*.safetensors.index.json` out (loaders would read them as part of
  the model); other files stay. A name the new version needs that is taken by a folder is refused
  before anything moves; should a rename of the swap still fail, every file moved is moved back,
  so the older model still loads.
- A file DEST (a path ending in .safetensors) is replaced by one rename.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sparsesync.errors import ConfigError, OutputError

__all__ = ["write_dest"]


def _is_model_file(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json"))


def _is_folder(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink()


def write_dest(state: dict[str, Any], dest: Path, version: int, digest: str, adapter: Any = None,
               extra: dict[str, bytes] | None = None) -> list[Path]:
    """Write `state` to DEST (see the module docstring); `adapter` (an AdapterMeta): as a PEFT
    adapter folder; `extra`: verified checkpoint files (config, tokenizer) written beside the
    weights in a folder DEST. Returns the paths written, under `dest` as given."""
    from safetensors.torch import save_file

    from sparsesync.codec import algo_of, write_anchor

    dest = Path(dest).absolute()
    one_file = dest.suffix == ".safetensors"
    stage: Path | None = None
    try:
        if dest.is_symlink() and not dest.exists():
            raise OutputError(f"{dest} is a link to {os.readlink(dest)}, which does not exist",
                              hint="remove the link, or name an existing folder for DEST")
        real = Path(os.path.realpath(dest))  # the files live there: stage on its file system
        if real.exists() and not (real.is_file() if one_file else real.is_dir()):
            raise OutputError(f"{dest} exists and is not a {'file' if one_file else 'folder'}",
                              hint="name a folder, or a path ending in .safetensors for one file")
        if one_file and adapter is not None:
            raise OutputError(
                f"{dest}: an adapter run is pulled into a folder (adapter_config.json + adapter_model.safetensors)",
                hint="name a folder for DEST",
            )
        real.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{real.name}.sparsesync-", dir=_stage_parent(real, one_file)))
        if one_file:
            save_file(state, str(stage / real.name), metadata={"sparsesync_version": str(version),
                                                               "sparsesync_state_digest": digest})
            os.replace(stage / real.name, real)
            return [dest]
        if adapter is not None:
            from sparsesync.lora.bridge import write_adapter_folder

            files = write_adapter_folder(state, adapter, stage / "model", version=version, digest=digest)
        else:
            # the run's digest algorithm
            files = write_anchor(state, stage / "model", version=version, algo=algo_of(digest))
        from sparsesync.protocol.extras import write_files

        files = write_files(stage / "model", extra or {}) + list(files)  # the model files last (index last)
        if not real.exists():
            os.replace(stage / "model", real)  # DEST appears complete, or not at all
        else:
            _swap_in(files, real, stage / "old", version)
        return [dest / f.name for f in files]
    except (OutputError, ConfigError):  # ConfigError: an adapter config its tensors do not fit (nothing written)
        raise
    except Exception as e:  # OSError, or safetensors' own error for the same causes
        raise OutputError(f"cannot write version {version} to {dest}: {' '.join(str(e).split())[:300]}",
                          hint=_output_hint(e)) from e
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)


def _stage_parent(real: Path, one_file: bool) -> Path:
    """Where the staging folder goes: beside the real DEST when that is on DEST's file system,
    else (a folder DEST that is a mount point) inside it; a rename never crosses devices."""
    if one_file or not real.exists() or os.stat(real.parent).st_dev == os.stat(real).st_dev:
        return real.parent
    return real


def _swap_in(files: list[Path], real: Path, old: Path, version: int) -> None:
    """Move the staged `files` into the existing folder `real` and every other model file out
    (into `old`, which goes with the stage), all or nothing (see the module docstring)."""
    new = {f.name for f in files}
    stale = [p for p in real.iterdir() if _is_model_file(p.name) and p.name not in new]
    clash = [real / n for n in sorted(new) if _is_folder(real / n)] + [p for p in stale if _is_folder(p)]
    if clash:
        raise OutputError(f"{clash[0]} is a folder where version {version} writes a model or checkpoint file",
                          hint="move that folder out of DEST, or pull into another DEST")
    old.mkdir()
    moved_in: list[tuple[Path, Path | None]] = []  # (DEST path, what was there, kept in `old`)
    moved_out: list[Path] = []
    try:
        for p in stale:  # indexes first, so no loader follows a stale index to a new shard set
            if p.name.endswith(".json"):
                os.replace(p, old / p.name)
                moved_out.append(p)
        for f in files:  # the checkpoint files, the shards, then the index: each replaced by one rename
            target, kept = real / f.name, None
            if os.path.lexists(target):
                kept = old / f.name
                _keep(target, kept)
            os.replace(f, target)
            moved_in.append((target, kept))
        for p in stale:
            if p not in moved_out:
                os.replace(p, old / p.name)
                moved_out.append(p)
    except BaseException:
        for target, kept in reversed(moved_in):  # back as it was: the older model loads
            if kept is not None:
                os.replace(kept, target)
            else:
                os.unlink(target)
        for p in reversed(moved_out):
            os.replace(old / p.name, p)
        raise


def _keep(target: Path, kept: Path) -> None:
    """Keep what is at `target` as `kept` (same file system) while a rename replaces it: a hard
    link, so `target` never goes missing; where the file system has none, the file is moved."""
    try:
        os.link(target, kept, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        os.replace(target, kept)


def _output_hint(e: Exception) -> str:
    text = str(e)
    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or "No space left" in text or "too large" in text:
        return "free disk space (or raise the file size limit) where DEST lives, or pull elsewhere"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "ermission denied" in text or "Read-only" in text:
        return "DEST and its folder must be writable by this user; choose another DEST"
    return "check DEST (a writable folder, or a path ending in .safetensors)"
