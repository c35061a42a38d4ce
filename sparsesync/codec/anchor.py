"""Anchors: a full snapshot of one version as plain (HF-style, sharded) safetensors files.

Guarantee: any safetensors tool loads an anchor; `load_anchor` returns tensors only after every
tensor's bytes matched the digest recorded when it was written (DigestMismatchError otherwise),
and rejects malformed or inconsistent files with PatchFormatError. Layout: one
`model.safetensors`, or `model-0000i-of-0000N.safetensors` shards plus
`model.safetensors.index.json` (the transformers convention). Each shard's `__metadata__`
holds `format: pt`, `sparsesync.version` and `sparsesync.digests` (JSON name -> xxh3_64 hex);
the index's `metadata` holds `total_size`, `sparsesync.version` and `sparsesync.state_digest`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from sparsesync.codec._container import header_length, parse_header_json
from sparsesync.codec.digest import state_digest, tensor_digest
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


def write_anchor_shard(tensors: Mapping[str, torch.Tensor], path: Path, *, version: int, alone: bool = False) -> dict[str, str]:
    """Write one anchor file of whole tensors at `path`, with their digests in its metadata (and
    the state digest when it is the anchor's only file, `alone`); returns the digests."""
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    digests = {n: tensor_digest(t) for n, t in cpu.items()}
    meta = {"format": "pt", "sparsesync.version": str(version), "sparsesync.digests": json.dumps(digests, separators=(",", ":"))}
    if alone:
        meta["sparsesync.state_digest"] = state_digest(digests)
    save_file(cpu, str(path), metadata=meta)
    return digests


def write_anchor_index(directory: Path, weight_map: Mapping[str, str], digests: Mapping[str, str], *, version: int,
                       total_size: int) -> Path:
    """Write the index of a sharded anchor (tensor -> file, and the state digest over `digests`)."""
    index = {
        "metadata": {"total_size": total_size, "sparsesync.version": str(version), "sparsesync.state_digest": state_digest(digests)},
        "weight_map": dict(weight_map),
    }
    path = Path(directory) / INDEX_NAME
    path.write_text(json.dumps(index, indent=2, sort_keys=True))
    return path


def write_anchor(state: Mapping[str, torch.Tensor], directory: Path, *, version: int, max_shard_bytes: int = 5 << 30) -> list[Path]:
    """Write `state` as an anchor of `version` into `directory`; returns the files written
    (shards first, then the index when sharded). Memory: one shard's tensors copied to CPU."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = _shard_plan(state, max_shard_bytes)
    digests: dict[str, str] = {}
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, names in enumerate(plan):
        fname = shard_name(i + 1, len(plan))
        digests.update(write_anchor_shard({n: state[n] for n in names}, directory / fname, version=version, alone=len(plan) == 1))
        files.append(directory / fname)
        weight_map.update({n: fname for n in names})
    if len(plan) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        files.append(write_anchor_index(directory, weight_map, digests, version=version, total_size=total))
    return files


def _bad(path: Path, msg: str) -> PatchFormatError:
    return PatchFormatError(f"anchor file '{path}': {msg}", hint="the anchor is corrupt or not a sparsesync anchor; fetch it again")


def _shard_meta(path: Path) -> dict[str, str]:
    with open(path, "rb") as f:
        n = header_length(f.read(8))
        if 8 + n > os.fstat(f.fileno()).st_size:
            raise _bad(path, f"declared header length {n} B exceeds the file")
        meta, _ = parse_header_json(f.read(n))
    return meta


def load_anchor(files: Sequence[Path]) -> tuple[dict[str, torch.Tensor], AnchorInfo]:
    """Load an anchor from its files (shards, with or without the index) on CPU, verifying every
    tensor's digest and that all files agree on the version."""
    paths = [Path(f) for f in files]
    index_paths = [p for p in paths if p.name.endswith(".index.json")]
    shards = sorted(p for p in paths if p.suffix == ".safetensors")
    if not shards or len(index_paths) > 1:
        raise PatchFormatError(f"anchor files {[str(p) for p in paths]}: expected one or more .safetensors shards and at most one index", hint="pass the anchor's files")
    state: dict[str, torch.Tensor] = {}
    digests: dict[str, str] = {}
    home: dict[str, str] = {}  # tensor -> the file holding it
    versions: set[str] = set()
    for p in shards:
        meta = _shard_meta(p)
        try:
            shard_digests = json.loads(meta.get("sparsesync.digests", ""))
        except (ValueError, RecursionError):
            raise _bad(p, "metadata 'sparsesync.digests' missing or not JSON") from None
        if not isinstance(shard_digests, dict) or not all(isinstance(v, str) for v in shard_digests.values()):
            raise _bad(p, "metadata 'sparsesync.digests' is not a map of name -> digest")
        versions.add(meta.get("sparsesync.version", ""))
        try:
            with safe_open(str(p), framework="pt", device="cpu") as f:
                names = list(f.keys())
                if set(names) != set(shard_digests):
                    raise _bad(p, f"tensors {sorted(set(names) ^ set(shard_digests))[:5]} lack a digest or a tensor")
                for name in names:
                    if name in state:
                        raise _bad(p, f"tensor '{name}' appears in two shards")
                    t = f.get_tensor(name)
                    got = tensor_digest(t)
                    if got != shard_digests[name]:
                        raise DigestMismatchError(
                            f"anchor file '{p}': tensor '{name}': digest {got}, expected {shard_digests[name]}", hint="the anchor is corrupt; fetch it again"
                        )
                    state[name] = t
                    digests[name] = got
                    home[name] = p.name
        except SafetensorError as e:
            raise _bad(p, f"not a valid safetensors file ({e})") from None
    if len(versions) != 1 or not next(iter(versions)).isdigit():
        raise PatchFormatError(f"anchor files disagree on or lack 'sparsesync.version': {sorted(versions)}", hint="pass the files of one anchor")
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
            raise DigestMismatchError(f"anchor index '{index_paths[0]}': state digest {imeta.get('sparsesync.state_digest')!r}, computed {sd}", hint="the anchor is corrupt; fetch it again")
    elif len(shards) > 1:
        raise PatchFormatError(f"anchor has {len(shards)} shards but no {INDEX_NAME}", hint="pass the index file with the shards")
    return state, AnchorInfo(version, digests, sd)
