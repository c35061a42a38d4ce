"""Loading an anchor's files straight into an engine's tensors through one bounded host buffer.

Guarantee: `load_into(files, live, rec)` returns the anchor's per-tensor digests only when every
tensor of `live` (names, dtypes and shapes exactly the anchor's, nothing missing or extra) now
holds the bytes of its shard, each hashed where it lives (on its device, "xxh3b"; an "xxh3" digest
of an older run on the host, in 64 MiB pieces) against the digest its shard records, every shard
names `rec`'s version, and the state digest of those digests is the commit's (`Run.check_anchor`).
Otherwise it raises (PatchFormatError, DigestMismatchError, MirrorMismatchError) and the tensors'
bits are unknown (the caller reports no version until a load passes). Host memory: one buffer of
`chunk` bytes (pinned where the tensors are on CUDA), whatever the size of a tensor; each chunk is
read from the file into it and copied to the tensor's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from sparsesync.codec import state_digest, tensor_digest
from sparsesync.codec._container import ST_DTYPES
from sparsesync.codec.anchor import _bad, read_shard
from sparsesync.codec.device_apply import device_digests
from sparsesync.codec.digest import BLOCKS_ALGO, algo_of
from sparsesync.errors import DigestMismatchError, MirrorMismatchError
from sparsesync.protocol.records import CommitRecord
from sparsesync.protocol.run import Run

CHUNK = 64 << 20  # bytes read from a file and copied to the device at a time


def load_into(run: Run, rec: CommitRecord, files: list[Path], live: Mapping[str, torch.Tensor], *,
              chunk: int | None = None) -> dict[str, str]:
    """Read the anchor `files` of `rec` into `live` (module docstring; `chunk`: default CHUNK); its digests."""
    chunk = chunk or CHUNK
    shards = sorted(p for p in files if p.suffix == ".safetensors")
    cuda = any(t.device.type == "cuda" for t in live.values())
    buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda and torch.cuda.is_available())
    digests: dict[str, str] = {}
    seen: set[str] = set()
    for p in shards:
        meta, streams, recorded = read_shard(p)
        if meta.get("sparsesync.version") != str(rec.version):
            raise _bad(p, f"version {meta.get('sparsesync.version')!r}, expected {rec.version}")
        with open(p, "rb", buffering=0) as f:
            for name, s in sorted(streams.items(), key=lambda kv: kv[1].start):
                t = live.get(name)
                dtype = ST_DTYPES.get(s.dtype, (None,))[0]
                if t is None or name in seen or t.dtype != dtype or tuple(t.shape) != s.shape or not t.is_contiguous():
                    raise MirrorMismatchError(
                        f"anchor of version {rec.version}: tensor '{name}' ({s.dtype} {list(s.shape)}) does not fit "
                        f"the engine's ({'missing' if t is None else f'{t.dtype} {list(t.shape)}'})",
                        hint="publish the model the replica serves",
                    )
                _copy_in(f, s.start, s.nbytes, t.detach().reshape(-1).view(torch.uint8), buf, p)
                seen.add(name)
        got = _digests_of({n: live[n] for n in streams}, recorded)
        bad = [f"tensor '{n}': digest {got[n]}, expected {d}" for n, d in recorded.items() if got[n] != d]
        if bad:
            raise DigestMismatchError(f"anchor file '{p}' loaded into the engine: " + "; ".join(bad[:5]),
                                      hint="the anchor is corrupt; fetch it again")
        digests.update(got)
    if seen != set(live):
        raise MirrorMismatchError(f"anchor of version {rec.version} lacks the engine's tensors "
                                  f"{sorted(set(live) - seen)[:5]}", hint="publish the model the replica serves")
    run.check_anchor(rec, rec.version, state_digest(digests))
    return digests


def _copy_in(f: object, start: int, nbytes: int, dst: torch.Tensor, buf: torch.Tensor, path: Path) -> None:
    """`nbytes` at `start` of the open file `f` into the bytes `dst`, through `buf`."""
    f.seek(start)  # type: ignore[attr-defined]
    view = buf.numpy().data
    done = 0
    while done < nbytes:
        want = min(buf.numel(), nbytes - done)
        got = 0
        while got < want:
            n = f.readinto(view[got:want])  # type: ignore[attr-defined]
            if not n:
                raise _bad(path, f"ends inside a tensor ({done + got} of {nbytes} bytes read)")
            got += n
        dst[done : done + want].copy_(buf[:want])  # from pinned or pageable memory: done when it returns
        done += want


def _digests_of(tensors: Mapping[str, torch.Tensor], recorded: Mapping[str, str]) -> dict[str, str]:
    """Each tensor's digest in the algorithm of its recorded one, "xxh3b" on its device."""
    blocks = {n: t for n, t in tensors.items() if algo_of(recorded[n]) == BLOCKS_ALGO}
    out = device_digests(blocks)
    out.update({n: tensor_digest(t, algo_of(recorded[n])) for n, t in tensors.items() if n not in blocks})
    return out
