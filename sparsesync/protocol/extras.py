"""A checkpoint's small non-weight files, carried by a run: config, generation config, tokenizer.

So that a pulled folder loads as is (`AutoModelForCausalLM.from_pretrained(DEST)`, or
`PeftModel.from_pretrained(base, DEST)` for an adapter run), a commit record may list, in its
`files` field, the checkpoint's files that are not weights (docs/protocol.md, "Checkpoint
files"). Each is an object `files/v{version}-e{epoch}-{uid}/{name}` stored before the commit,
referenced with its size and xxh3 like every other object, and checked on read.

Guarantees:
- Only the names in `FILE_NAMES` travel (config, generation config, tokenizer files, chat
  template): no `.py` file, no pickle (`*.bin`, `*.pt`, `*.pth`), no dotfile, no sub-folder.
  Files are bytes: nothing here parses, imports or executes them.
- Bounded: at most `MAX_FILES` files of at most `MAX_FILE_BYTES` each and `MAX_TOTAL_BYTES` in
  all, on write (`collect_files` refuses a larger allowed file with a one-line ConfigError) and
  on read (a record listing more, larger, or other names is not a commit).
- Readers write a file only after its bytes matched the recorded size and digest (`Run.fetch`).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparsesync.errors import ConfigError

FILES = "files/"
FILE_NAMES = frozenset({
    "config.json", "generation_config.json",  # the model (full-weight runs only)
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
})
MODEL_FILES = frozenset({"config.json", "generation_config.json"})  # not carried by adapter runs
MAX_FILES = 32
MAX_FILE_BYTES = 64 << 20  # a large tokenizer.json is ~35 MB
MAX_TOTAL_BYTES = 128 << 20

_FILE_KEY_RE = re.compile(r"^files/v(\d{10})-e(\d{6})-[0-9a-f]+/([^/]+)$")
_HEX = re.compile(r"^[0-9a-f]{8,64}$")


@dataclass(frozen=True)
class FileRef:
    """A checkpoint file of a version: written to DEST as `name`, stored at `key`."""

    name: str
    key: str
    size: int
    xxh3: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "size": self.size, "xxh3": self.xxh3}


def file_key(version: int, epoch: int, uid: str, name: str) -> str:
    return f"{FILES}v{version:010d}-e{epoch:06d}-{uid}/{name}"


def file_version(key: str) -> int | None:
    """The version that first stored a checkpoint-file object (in its name), or None."""
    m = _FILE_KEY_RE.match(key)
    return int(m[1]) if m else None


def parse_files(raw: Any, version: int) -> list[FileRef]:
    """The `files` field of a commit record of `version`; ValueError with a one-line reason on
    anything but a list of `{name, key, size, xxh3}` within the bounds of the module docstring."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_FILES:
        raise ValueError(f"files is not a list of at most {MAX_FILES} objects")
    out: list[FileRef] = []
    for i, f in enumerate(raw):
        if not isinstance(f, dict) or set(f) != {"name", "key", "size", "xxh3"}:
            raise ValueError(f"files[{i}] is not an object with exactly name, key, size, xxh3")
        name, key, size, digest = f["name"], f["key"], f["size"], f["xxh3"]
        if not isinstance(name, str) or name not in FILE_NAMES:
            raise ValueError(f"files[{i}].name {str(name)[:80]!r} is not a checkpoint file name sparsesync carries "
                             f"({', '.join(sorted(FILE_NAMES)[:4])}, ...)")
        m = _FILE_KEY_RE.match(key) if isinstance(key, str) and len(key) <= 1024 else None
        if m is None or m[3] != name or int(m[1]) > version:
            raise ValueError(f"files[{i}].key {str(key)[:120]!r} is not files/v<version <= {version}>-e<epoch>-<uid>/{name}")
        if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
            raise ValueError(f"files[{i}] ({name}) size {str(size)[:40]} is not an integer in [0, {MAX_FILE_BYTES}]")
        if not isinstance(digest, str) or not _HEX.match(digest):
            raise ValueError(f"files[{i}] ({name}) xxh3 is not a hex digest")
        out.append(FileRef(name, key, size, digest))
    if len({f.name for f in out}) != len(out):
        raise ValueError("files lists one name twice")
    if sum(f.size for f in out) > MAX_TOTAL_BYTES:
        raise ValueError(f"files hold more than {MAX_TOTAL_BYTES} bytes in all")
    return out


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
            data = _read_bounded(folder / name)
            if data is not None:
                out[name] = data
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
    """The bytes of a regular file (a link to one is followed: Hub caches link into blobs), at
    most MAX_FILE_BYTES + 1 of them; None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path} is not a regular file", hint="checkpoint files must be plain files")
    with open(path, "rb") as f:
        return f.read(MAX_FILE_BYTES + 1)


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
        if name not in FILE_NAMES or "/" in name or name.startswith("."):  # parse_files allows no other
            raise ConfigError(f"refusing to write checkpoint file {name!r}")
        (dest / name).write_bytes(data)
        out.append(dest / name)
    return out
