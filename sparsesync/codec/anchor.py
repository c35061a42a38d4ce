"""Anchors: a full snapshot of one version as plain (HF-style, sharded) safetensors files.

Guarantee: any safetensors tool loads an anchor; `load_anchor` returns tensors only after every
tensor's bytes matched the digest recorded when it was written (DigestMismatchError otherwise),
and rejects malformed or inconsistent files with PatchFormatError. Layout: one
`model.safetensors`, or `model-0000i-of-0000N.safetensors` shards plus
`model.safetensors.index.json` (the transformers convention). Each shard's `__metadata__`
holds `format: pt`, `sparsesync.version` and `sparsesync.digests` (JSON name -> tensor digest, "xxh3b:" + hex or legacy
bare xxh3 hex); the index's `metadata` holds `total_size`, `sparsesync.version` and `sparsesync.state_digest`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparsesync.codec._container import (
    ST_DTYPES,
    Stream,
    header_length,
    parse_header_json,
    parse_streams,
)
from sparsesync.codec.digest import DEFAULT_ALGO, algo_of, is_digest, state_digest, tensor_digest
from sparsesync.errors import DigestMismatchError, PatchFormatError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class AnchorInfo:
    """What an anchor says about itself."""

    version: int
    digests: dict[str, str]  # name -> xxh3_64 hex of the tensor's bytes
    state_digest: str  # `state_digest(digests)`


def _shard_plan(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nb
    return shards


def shard_name(index: int, count: int) -> str:
    """The file name of shard `index` (1-based) of `count`: `model.safetensors` when alone,
    else transformers' `model-0000i-of-0000N.safetensors`."""
    return SINGLE_NAME if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def write_anchor_shard(tensors: Mapping[str, torch.Tensor], path: Path, *, version: int, alone: bool = False,
                       algo: str = DEFAULT_ALGO) -> dict[str, str]:
    """Write one anchor file of whole tensors at `path`, with their `algo` digests in its
    metadata (and the state digest when it is the anchor's only file, `alone`); returns the digests."""
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    digests = {n: tensor_digest(t, algo) for n, t in cpu.items()}
    meta = {
        "format": "pt",
        "sparsesync.version": str(version),
        "sparsesync.digests": json.dumps(digests, separators=(",", ":")),
    }
    if alone:
        meta["sparsesync.state_digest"] = state_digest(digests)
    save_file(cpu, str(path), metadata=meta)
    return digests


def write_anchor_index(directory: Path, weight_map: Mapping[str, str], digests: Mapping[str, str], *, version: int,
                       total_size: int) -> Path:
    """Write the index of a sharded anchor (tensor -> file, and the state digest over `digests`)."""
    index = {
        "metadata": {
            "total_size": total_size,
            "sparsesync.version": str(version),
            "sparsesync.state_digest": state_digest(digests),
        },
        "weight_map": dict(weight_map),
    }
    path = Path(directory) / INDEX_NAME
    path.write_text(json.dumps(index, indent=2, sort_keys=True))
    return path


def write_anchor(state: Mapping[str, torch.Tensor], directory: Path, *, version: int, max_shard_bytes: int = 5 << 30,
                 algo: str = DEFAULT_ALGO) -> list[Path]:
    """Write `state` as an anchor of `version` into `directory` with `algo` digests; returns the
    files written (shards first, then the index when sharded). Memory: one shard's tensors copied to CPU."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = _shard_plan(state, max_shard_bytes)
    digests: dict[str, str] = {}
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, names in enumerate(plan):
        fname = shard_name(i + 1, len(plan))
        digests.update(
            write_anchor_shard(
                {n: state[n] for n in names}, directory / fname, version=version, alone=len(plan) == 1, algo=algo
            )
        )
        files.append(directory / fname)
        weight_map.update({n: fname for n in names})
    if len(plan) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        files.append(write_anchor_index(directory, weight_map, digests, version=version, total_size=total))
    return files


def _bad(path: Path, msg: str) -> PatchFormatError:
    return PatchFormatError(
        f"anchor file '{path}': {msg}", hint="the anchor is corrupt or not a sparsesync anchor; fetch it again"
    )


def _shard_header(path: Path) -> tuple[dict[str, str], dict[str, Stream]]:
    """A shard's metadata and its validated tensor table (offsets within the file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = header_length(f.read(8))
        if 8 + n > size:
            raise _bad(path, f"declared header length {n} B exceeds the file")
        meta, table = parse_header_json(f.read(n))
    try:
        return meta, parse_streams(table, 8 + n, size - 8 - n)
    except PatchFormatError as e:
        raise _bad(path, f"not a valid safetensors file ({e})") from None


def read_shard(path: Path) -> tuple[dict[str, str], dict[str, Stream], dict[str, str]]:
    """A shard's metadata, its validated tensor table and its recorded digest of each tensor
    (`sparsesync.digests`: one well-formed digest for every tensor and no other name)."""
    meta, streams = _shard_header(path)
    try:
        digests = json.loads(meta.get("sparsesync.digests", ""))
    except (ValueError, RecursionError):
        raise _bad(path, "metadata 'sparsesync.digests' missing or not JSON") from None
    if not isinstance(digests, dict) or not all(is_digest(v) for v in digests.values()):
        raise _bad(path, "metadata 'sparsesync.digests' is not a map of name -> digest")
    if set(streams) != set(digests):
        raise _bad(path, f"tensors {sorted(set(streams) ^ set(digests))[:5]} lack a digest or a tensor")
    return meta, streams, digests


Alloc = Callable[[Mapping[str, tuple[torch.dtype, tuple[int, ...]]]], dict[str, torch.Tensor]]


def _read_into(f: io.RawIOBase, t: torch.Tensor, start: int, nbytes: int, path: Path) -> None:
    """Read `nbytes` at `start` of `f` straight into `t`'s memory (no intermediate copy)."""
    if nbytes == 0:
        return
    buf = t.reshape(-1).view(torch.uint8).numpy().data  # the tensor's memory
    f.seek(start)
    got = 0
    while got < nbytes:
        n = f.readinto(buf[got:])
        if not n:
            raise _bad(path, f"ends inside a tensor ({got} of {nbytes} bytes read)")
        got += n


# one pass over the anchor's files that checks each header, version and digest as it reads (docs/format.md); the checks
# share the read state
def load_anchor(  # noqa: C901, PLR0915
    files: Sequence[Path], *, alloc: Alloc | None = None,
                written: Callable[[torch.Tensor], object] | None = None) -> tuple[dict[str, torch.Tensor], AnchorInfo]:
    """Load an anchor from its files (shards, with or without the index) on CPU, verifying every
    tensor's digest and that all files agree on the version.

    Each tensor's bytes are read from its file straight into its destination tensor: by default
    new CPU tensors; with `alloc`, the tensors `alloc({name: (dtype, shape)})` returns (e.g. views
    of a file-backed map, `sparsesync.protocol.follower.mirror`). Memory: the tensors, nothing else.
    `written` is called with each tensor once it is read and its digest checked (a holder may
    then page it out)."""
    paths = [Path(f) for f in files]
    index_paths = [p for p in paths if p.name.endswith(".index.json")]
    shards = sorted(p for p in paths if p.suffix == ".safetensors")
    if not shards or len(index_paths) > 1:
        raise PatchFormatError(
            f"anchor files {[str(p) for p in paths]}: expected one or more .safetensors shards and at most one index",
            hint="pass the anchor's files",
        )
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    home: dict[str, str] = {}  # tensor -> the file holding it
    versions: set[str] = set()
    tables: list[tuple[Path, dict[str, Stream], dict[str, str]]] = []
    for p in shards:
        meta, streams, shard_digests = read_shard(p)
        versions.add(meta.get("sparsesync.version", ""))
        for name, s in streams.items():
            if name in layout:
                raise _bad(p, f"tensor '{name}' appears in two shards")
            layout[name] = (ST_DTYPES[s.dtype][0], s.shape)
            home[name] = p.name
        tables.append((p, streams, shard_digests))
    state = (
        alloc(layout) if alloc is not None else {n: torch.empty(shape, dtype=dt) for n, (dt, shape) in layout.items()}
    )
    digests: dict[str, str] = {}
    for p, streams, shard_digests in tables:
        with open(p, "rb", buffering=0) as f:
            for name, s in sorted(streams.items(), key=lambda kv: kv[1].start):
                t = state[name]
                _read_into(f, t, s.start, s.nbytes, p)
                got = tensor_digest(t, algo_of(shard_digests[name]))
                if got != shard_digests[name]:
                    raise DigestMismatchError(
                        f"anchor file '{p}': tensor '{name}': digest {got}, expected {shard_digests[name]}",
                        hint="the anchor is corrupt; fetch it again",
                    )
                digests[name] = got
                if written is not None:
                    written(t)
    if len(versions) != 1 or not next(iter(versions)).isdigit():
        raise PatchFormatError(
            f"anchor files disagree on or lack 'sparsesync.version': {sorted(versions)}",
            hint="pass the files of one anchor",
        )
    version = int(next(iter(versions)))
    sd = state_digest(digests)
    if index_paths:
        try:
            index = json.loads(index_paths[0].read_text())
            imeta, wmap = index["metadata"], index["weight_map"]
            if not isinstance(imeta, dict):
                raise TypeError("metadata is not an object")
        except (ValueError, RecursionError, KeyError, TypeError) as e:  # ValueError covers JSON and UTF-8 errors
            raise _bad(index_paths[0], f"not a valid index ({e})") from None
        if not isinstance(wmap, dict) or not all(isinstance(f, str) for f in wmap.values()):
            raise _bad(index_paths[0], "weight_map is not a map of tensor name -> file name")
        if set(wmap) != set(state) or set(wmap.values()) != {p.name for p in shards}:
            raise _bad(index_paths[0], "weight_map does not match the shards' tensors (a shard is missing or extra)")
        if wrong := sorted(n for n in state if wmap[n] != home[n])[:3]:
            raise _bad(index_paths[0], f"weight_map puts tensors {wrong} in other files than the ones holding them")
        if imeta.get("sparsesync.version") != str(version):
            raise _bad(index_paths[0], f"version {imeta.get('sparsesync.version')!r}, expected {version}")
        if imeta.get("sparsesync.state_digest") != sd:
            raise DigestMismatchError(
                f"anchor index '{index_paths[0]}': state digest {imeta.get('sparsesync.state_digest')!r}, computed "
                f"{sd}",
                hint="the anchor is corrupt; fetch it again",
            )
    elif len(shards) > 1:
        raise PatchFormatError(
            f"anchor has {len(shards)} shards but no {INDEX_NAME}", hint="pass the index file with the shards"
        )
    return state, AnchorInfo(version, digests, sd)
