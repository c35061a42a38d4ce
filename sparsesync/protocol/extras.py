"""A checkpoint's small non-weight files, carried by a run: config, generation config, tokenizer.

So that a pulled folder loads as is (`AutoModelForCausalLM.from_pretrained(DEST)`, or
`PeftModel.from_pretrained(base, DEST)` for an adapter run), a commit record may list, in its
`files` field, the checkpoint's files that are not weights (docs/protocol.md, "Checkpoint
files"). Each is an object `files/v{version}-e{epoch}-{uid}/{name}` (`keys.file_key`) stored
before the commit, referenced with its size and xxh3 like every other object (`records.FileRef`),
and checked on read. This module collects them on the writer's side and writes them on the
reader's; the bounds and the names allowed are the schema's (`records`).

Guarantees:
- Only the names in `FILE_NAMES` travel (config, generation config, tokenizer files, chat
  template): no `.py` file, no pickle (`*.bin`, `*.pt`, `*.pth`), no dotfile, no sub-folder.
  Files are bytes: nothing here parses, imports or executes them.
- Nothing outside the folder is read: a file that links out of it, or is not a regular file
  (a FIFO, a device), is refused with a ConfigError naming it (`checkpoint.open_in_folder`).
- Bounded: at most `MAX_FILES` files of at most `MAX_FILE_BYTES` each and `MAX_TOTAL_BYTES` in
  all, on write (`collect_files` refuses a larger allowed file with a one-line ConfigError) and
  on read (a record listing more, larger, or other names is not a commit).
- Readers write a file only after its bytes matched the recorded size and digest (`Run.fetch`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparsesync.checkpoint import read_in_folder
from sparsesync.errors import ConfigError
from sparsesync.protocol.records import FILE_NAMES, MAX_FILE_BYTES, MAX_TOTAL_BYTES

MODEL_FILES = frozenset({"config.json", "generation_config.json"})  # not carried by adapter runs


# -- the writer side --------------------------------------------------------------------------
def collect_files(source: str | Path | Mapping[str, bytes] | None, *, adapter: bool = False) -> dict[str, bytes]:
    """The checkpoint files a run carries from `source`: a folder (a `save_pretrained` output;
    other files in it are left out) or `{name: bytes}`. `adapter`: leave out config.json and
    generation_config.json (an adapter folder loads with the base model's). ConfigError, before
    anything is uploaded, for a mapping name outside `FILE_NAMES` or a file over the bounds."""
    if source is None:
        return {}
    out: dict[str, bytes] = {}
    if isinstance(source, Mapping):
        for name, data in source.items():
            if name not in FILE_NAMES:
                raise ConfigError(f"checkpoint file {name!r} is not one sparsesync carries",
                                  hint=f"carry only {', '.join(sorted(FILE_NAMES))}")
            out[name] = bytes(data)
    else:
        folder = Path(source)
        if not folder.is_dir():
            raise ConfigError(f"{folder} is not a folder", hint="pass the folder save_pretrained wrote")
        for name in sorted(FILE_NAMES):
            read = _read_bounded(folder / name)
            if read is not None:
                out[name] = read
    if adapter:
        out = {n: d for n, d in out.items() if n not in MODEL_FILES}
    for name, data in out.items():
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError(f"checkpoint file {name} has {len(data):,} bytes, over the limit of {MAX_FILE_BYTES:,}",
                              hint="a run carries only small non-weight files; leave this one out of the folder")
    total = sum(len(d) for d in out.values())
    if total > MAX_TOTAL_BYTES:
        raise ConfigError(f"the checkpoint files hold {total:,} bytes, over the limit of {MAX_TOTAL_BYTES:,}",
                          hint="leave large files out of the folder")
    return out


def _read_bounded(path: Path) -> bytes | None:
    """At most MAX_FILE_BYTES + 1 bytes of the regular file `path` of its folder, never a file
    outside that folder (a link out of it, or a FIFO or device, is a ConfigError:
    `checkpoint.open_in_folder`; a Hugging Face cache snapshot's links into its blobs are
    followed); None when there is none."""
    return read_in_folder(path, path.parent, MAX_FILE_BYTES + 1)


def files_from_model(model: Any = None, tokenizer: Any = None, *, adapter: bool = False) -> dict[str, bytes]:
    """What `save_pretrained` writes beside the weights for `model` (its config and generation
    config; not for an adapter) and `tokenizer` (tokenizer files, chat template), as `collect_files`
    returns them. Either may be None; objects without `save_pretrained` are skipped."""
    with tempfile.TemporaryDirectory(prefix="sparsesync-files-") as tmp:
        if model is not None and not adapter:
            for obj in (getattr(model, "config", None), getattr(model, "generation_config", None)):
                if obj is not None and hasattr(obj, "save_pretrained"):
                    obj.save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        return collect_files(Path(tmp), adapter=adapter)


# -- the reader side --------------------------------------------------------------------------
def write_files(dest: Path, files: Mapping[str, bytes]) -> list[Path]:
    """Write verified checkpoint files into the folder `dest` (names checked again)."""
    out = []
    for name, data in sorted(files.items()):
        if name not in FILE_NAMES or "/" in name or name.startswith("."):  # a commit record names no other
            raise ConfigError(f"refusing to write checkpoint file {name!r}")
        (dest / name).write_bytes(data)
        out.append(dest / name)
    return out
