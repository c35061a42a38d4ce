"""Reading a version in parts: each part fetched, checked and decoded as it lands, then all of
them applied, all or nothing (the parts themselves: `sparsesync.protocol.writer.parts`).

Guarantees:
- Reader (`apply_parts`): parts are fetched concurrently and each is checked (bytes, header,
  base state of its units) and decoded as it arrives, with nothing written; only when every part
  is verified and decoded are the weights written, then every target digest is checked, and on any
  failure every part's writes are undone: all or nothing. With `names`, only the parts holding
  those tensors are fetched (a pipeline stage, a tensor-parallel rank).
- Prefetch (`Prefetcher`): before a version is committed, a reader may fetch and decode the part
  objects already stored for its held version, and hash what each unit will hold once written
  (`digest_after_put`: each block copied, written and hashed aside), so that when the commit
  lands only the writes remain. Nothing prefetched is trusted: at apply time each part's bytes
  must match the size and digest the commit records and pass every check above, or it is
  fetched and decoded again; the predicted digests must equal the commit's target digests. They
  were computed from the same held bytes the writes start from: those bytes change only through
  this reader's own writes, which is what its digest records (checked against each part's base)
  assume too.
- `set_unit_digests` keeps a holder's digest record a partition of its state: recording a unit
  drops the digests of whatever it overlaps.
- `check_held` tells whether a holder's state still is the version its digest record says (every
  unit hashed, MirrorMismatchError naming each that is not): for state others may have written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TypeVar

import torch

from sparsesync.codec import (
    Patch,
    interrupts_deferred,
    read_patch,
    state_digest,
    tensor_digest,
    tensor_digests,
)
from sparsesync.codec.apply import SparseUpdate, Written, decode_patch, patch_algo, verify_digests, write_updates
from sparsesync.codec.diff import bits_view, to_np_bits
from sparsesync.codec.digest import DEFAULT_ALGO, algo_of, algos_of, bytes_digest, digest_after_put
from sparsesync.errors import (
    DigestMismatchError,
    MirrorMismatchError,
    PatchMismatchError,
    ProtocolError,
    SparsesyncError,
)
from sparsesync.protocol.keys import DELTAS, parse_part_key
from sparsesync.protocol.records import CommitRecord, PartRef, Unit
from sparsesync.store import Store

FETCH_THREADS = 4  # parts fetched at once by a reader
_SHARD_KEY = re.compile(r"^(.*)\[([0-9]+):([0-9]+)\]\Z")
_T = TypeVar("_T")


def unit_view(state: Mapping[str, torch.Tensor], unit: Unit) -> torch.Tensor:
    """The tensor (or its dim-0 rows) a unit covers, as a view into `state` (contiguous when the
    tensor is)."""
    t = state[unit.name]
    if unit.rows is None:
        return t
    start, stop = unit.rows
    if t.dim() == 0 or stop > t.shape[0]:
        raise PatchMismatchError(
            f"tensor {unit.name!r}: shape {list(t.shape)} has no rows [{start}, {stop})",
            hint="the holder's model does not match the run's (same names and shapes)",
        )
    return t[start:stop]


def set_unit_digests(digests: MutableMapping[str, str], items: Sequence[tuple[Unit, str]]) -> None:
    """Record each unit's digest (units of distinct keys), dropping the digests of whatever they
    overlap (the tensor as a whole, or other row ranges of it), in one pass over `digests`: the
    keys of `digests` always partition the state."""
    by_name: dict[str, list[Unit]] = {}
    for unit, _ in items:
        by_name.setdefault(unit.name, []).append(unit)
    stale = []
    for k in digests:
        held = _unit_of(k)
        rows = held.rows
        if any(
            rows is None or u.rows is None or (rows[0] < u.rows[1] and u.rows[0] < rows[1])
            for u in by_name.get(held.name, ())
        ):
            stale.append(k)
    for k in stale:
        del digests[k]
    for unit, digest in items:
        digests[unit.key] = digest


def held_digest(
    digests: Mapping[str, str], state: Mapping[str, torch.Tensor], unit: Unit, algo: str = DEFAULT_ALGO
) -> str:
    """The `algo` digest of what the holder has for `unit`: recorded, or hashed from its (verified) bytes."""
    d = digests.get(unit.key)
    return d if d is not None and algo_of(d) == algo else tensor_digest(unit_view(state, unit), algo)


def check_held(state: Mapping[str, torch.Tensor], digests: Mapping[str, str], rec: CommitRecord,
               *, written: Written | None = None) -> None:
    """Raise MirrorMismatchError unless `state` is version `rec`: `digests` (a partition of
    `state`, see `set_unit_digests`) make `rec`'s state digest and every unit's bytes in `state`
    hash to its digest. Reads all of `state`, 8 units at a time, each passed to `written` once
    hashed (a holder may then page it out); writes nothing."""
    keys = list(digests)
    names = {_unit_of(k).name for k in keys}
    bad = (
        []
        if state_digest(digests) == rec.state_digest
        else [f"its digests make state {state_digest(digests)}, expected {rec.state_digest}"]
    )
    if names != set(state):
        bad.append(f"its digests cover {len(names & set(state))} of its {len(state)} tensors")
    for i in range(0, 0 if bad else len(keys), 8):
        views = {k: unit_view(state, _unit_of(k)) for k in keys[i : i + 8]}
        got = tensor_digests(views, algos_of({k: digests[k] for k in views}))
        bad += [f"tensor {k!r}: digest {got[k]}, expected {digests[k]}" for k in views if got[k] != digests[k]]
        for v in views.values():
            if written is not None:
                written(v)
    if bad:
        raise MirrorMismatchError(f"the mirror of version {rec.version}: " + "; ".join(bad[:5])
                                  + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""),
                                  hint="another process wrote into the mirror's file; reloading from the run. Keep the "
                                       "mirror folder private to the replica (SPARSESYNC_MIRROR_DIR)")


# -- applying ------------------------------------------------------------------------------------
@dataclass
class _Staged:
    ref: PartRef
    views: dict[str, torch.Tensor]  # unit key -> view into the holder's tensors
    updates: dict[str, SparseUpdate]  # by unit key
    targets: dict[str, str]  # unit key -> digest after applying (every unit of the part)
    predicted: dict[str, str] | None = None  # unit key -> digest its writes will give (prefetched parts)


def parts_for(rec: CommitRecord, names: Sequence[str] | None) -> list[PartRef]:
    """The parts of `rec` a holder of tensors `names` (None: all) needs."""
    if names is None:
        return list(rec.parts)
    want = set(names)
    return [p for p in rec.parts if any(u.name in want for u in p.units)]


@dataclass
class _Decoded:
    size: int
    xxh3: str
    patch: Patch
    updates: dict[str, SparseUpdate]  # by unit key, decoded against the holder's bytes at `base`
    predicted: dict[str, str] | None = None  # unit key -> digest of its bytes once `updates` are written (CPU units)


class Prefetcher:
    """Fetches and decodes the stored (not yet committed) parts of the version after the one a
    holder has, so that `apply_parts` finds them decoded (see the module docstring)."""

    def __init__(self, store: Store, max_bytes: int = 1 << 30) -> None:
        self.store = store
        self.max_bytes = max_bytes  # part bytes held at most
        self._base: int | None = None
        self._done: dict[str, _Decoded | None] = {}  # key -> decoded, or None (failed: not retried)

    def poll(self, base_version: int, state: Mapping[str, torch.Tensor]) -> int:
        """Fetch and decode every new part object `base_version -> *`; returns how many. They are
        fetched `FETCH_THREADS` at a time and each is decoded as it lands (a reader that fell
        behind the writer catches up while the next parts are on the wire). Then it hashes what
        one decoded part's units will hold once written (`_predicted`): one part per poll, so
        that hashing never holds up the next listing for long."""
        if base_version != self._base:
            self._base, self._done = base_version, {}
        prefix = f"{DELTAS}v{base_version:010d}-"
        held = sum(d.size for d in self._done.values() if d)
        todo = []
        for o in self.store.list(prefix):
            if o.key in self._done or parse_part_key(o.key) is None:
                continue
            if held + o.size > self.max_bytes:
                break
            todo.append(o.key)
            held += o.size
        for key, fut in _as_fetched(self.store.get, todo):
            try:
                data = fut.result()
                patch = read_patch(data)
                views = {k: unit_view(state, _unit_of(k)) for k in patch.header.tensors}
                updates = decode_patch(patch, views, check_base_digest=False)
                self._done[key] = _Decoded(len(data), bytes_digest(data), patch, updates)
            except Exception:  # noqa: BLE001 - anything odd: the commit-time path fetches it again
                self._done[key] = None
        d = next((d for d in self._done.values() if d is not None and d.predicted is None), None)
        if d is not None:  # one part per poll: the next listing is never far off
            try:
                d.predicted = (
                    _predicted(
                        {k: unit_view(state, _unit_of(k)) for k in d.updates}, d.updates, patch_algo(d.patch.header)
                    )
                    or {}
                )
            except Exception:  # noqa: BLE001 - nothing predicted: the writes hash as they go
                d.predicted = {}
        return len(todo)

    def forget(self) -> None:
        """Drop everything prefetched (after a failed apply: the retry fetches and checks afresh)."""
        self._done = {}

    def take(self, ref: PartRef, base_version: int | None) -> _Decoded | None:
        """The prefetched part `ref`, when its bytes are the ones the commit records."""
        d = self._done.get(ref.key) if base_version == self._base else None
        return d if d is not None and (d.size, d.xxh3) == (ref.size, ref.xxh3) else None


def _predicted(
    views: Mapping[str, torch.Tensor], updates: Mapping[str, SparseUpdate], algo: str
) -> dict[str, str] | None:
    """The `algo` digest each unit's bytes will have once `updates` are written (`digest_after_put`,
    nothing written), or None if a unit is not in CPU memory."""
    if any(views[k].device.type != "cpu" for k in updates):
        return None
    out = {}
    for k, u in updates.items():
        flat = bits_view(views[k])
        out[k] = digest_after_put(to_np_bits(flat), u.indices.numpy(), u.values.view(flat.dtype).numpy(), algo)
    return out


def _as_fetched(fetch: Callable[[_T], bytes], items: Sequence[_T]) -> Iterator[tuple[_T, Future[bytes]]]:
    """Each of `items` with the future of its `fetch`, in the order they land (`FETCH_THREADS` at
    a time, each decoded by the caller while the next are on the wire); fetches not yet started
    are cancelled when the caller stops early."""
    if not items:
        return
    with ThreadPoolExecutor(max_workers=min(FETCH_THREADS, len(items)), thread_name_prefix="sparsesync-part") as ex:
        futures = {ex.submit(fetch, x): i for i, x in enumerate(items)}
        try:
            for fut in as_completed(futures):
                yield items[futures[fut]], fut
        finally:
            for f in futures:
                f.cancel()


def _unit_of(key: str) -> Unit:
    m = _SHARD_KEY.match(key) if key.endswith("]") else None
    return Unit(m[1], (int(m[2]), int(m[3]))) if m else Unit(key)


def apply_parts(fetch: Callable[[PartRef], bytes], rec: CommitRecord, state: MutableMapping[str, torch.Tensor],
                digests: MutableMapping[str, str], *, names: Sequence[str] | None = None,
                prefetched: Prefetcher | None = None, written: Written | None = None) -> dict[str, SparseUpdate]:
    """Apply the version `rec` (in parts) to `state` in place, all or nothing; update `digests`.

    `fetch` returns a part's bytes checked against its size and digest (`Run.fetch`). Parts are
    fetched `FETCH_THREADS` at a time and decoded as they arrive; nothing is written until every
    part (of those needed for `names`, default all) is verified and decoded. Returns the changed
    elements by tensor name in the tensor's own flat coordinates (what an engine's sparse loader
    takes). Raises DigestMismatchError/PatchMismatchError/ProtocolError/PatchFormatError with the
    failing part's key in `e.key` (and `e.written` when the writes had begun: undone, but the held
    bits were not what their digests said), leaving `state` and `digests` as they were.
    `written`: told of each tensor (a part's view of it) once its part is decoded against it,
    and again once its writes are done (`codec.write_updates`).
    """
    if not rec.parts:
        raise ProtocolError(f"version {rec.version} has no parts")
    try:
        return _apply_all(fetch, rec, state, digests, names, prefetched, written)
    except BaseException:
        if prefetched is not None:
            prefetched.forget()  # a retry fetches, decodes and hashes every part afresh
        raise


def _apply_all(fetch: Callable[[PartRef], bytes], rec: CommitRecord, state: MutableMapping[str, torch.Tensor],
               digests: MutableMapping[str, str], names: Sequence[str] | None, prefetched: Prefetcher | None,
               written: Written | None = None) -> dict[str, SparseUpdate]:
    """`apply_parts` once its arguments are checked."""
    refs = parts_for(rec, names)
    staged: list[_Staged] = []
    ready = {
        r.key: d for r in refs if prefetched is not None and (d := prefetched.take(r, rec.base_version)) is not None
    }
    for ref in refs:
        if ref.key in ready:
            try:
                staged.append(
                    _stage(
                        rec, ref, ready[ref.key].patch, state, digests, ready[ref.key].updates, ready[ref.key].predicted
                    )
                )
                _done_with(staged[-1], written)
            except SparsesyncError as e:
                e.key = ref.key
                raise
    for ref, fut in _as_fetched(fetch, [r for r in refs if r.key not in ready]):
        try:
            staged.append(_stage(rec, ref, read_patch(fut.result()), state, digests))
            _done_with(staged[-1], written)
        except SparsesyncError as e:
            e.key = ref.key
            raise
    with interrupts_deferred():  # a Ctrl-C waits for the writes or their undo
        return _write_all(rec, staged, digests, names, written)


def _done_with(s: _Staged, written: Written | None) -> None:
    """Tell `written` of a part's views once the part is decoded against them (the reads of
    their held bytes are done; the writes come once every part is staged)."""
    if written is not None:
        for view in s.views.values():
            written(view)


def _write_all(rec: CommitRecord, staged: list[_Staged], digests: MutableMapping[str, str],
               names: Sequence[str] | None, written_hook: Written | None = None) -> dict[str, SparseUpdate]:
    """`_apply_all` once every part is staged: write them all, check every digest, undo all on any failure."""
    # per part: the overwritten bits (for undo) and the digests of its units, hashed as they were
    # written (or, for a prefetched part, before: what its writes give, from the same held bytes)
    written: list[tuple[_Staged, dict[str, SparseUpdate], dict[str, str]]] = []
    try:
        for s in staged:
            if s.predicted is not None:
                written.append((s, write_updates(s.views, s.updates, written=written_hook), dict(s.predicted)))
                continue
            known: dict[str, str] = {}
            written.append(
                (
                    s,
                    write_updates(s.views, s.updates, digests=known, written=written_hook, algo=algos_of(s.targets)),
                    known,
                )
            )
        for s, _, known in written:
            try:
                verify_digests(s.views, s.targets, known=known)
            except DigestMismatchError as e:
                e.key, e.written = s.ref.key, True
                raise
        new = dict(digests)
        set_unit_digests(new, [(u, s.targets[u.key]) for s in staged for u in s.ref.units])
        if names is None and state_digest(new) != rec.state_digest:
            err = DigestMismatchError(
                f"after applying the {len(staged)} parts of version {rec.version} the state digest is "
                f"{state_digest(new)}, expected {rec.state_digest} (undone)",
                hint="the parts do not make up the committed version; reload from an anchor",
            )
            err.written = True
            raise err
    except BaseException:
        for s, old, _ in reversed(written):
            write_updates(s.views, old)
        raise
    digests.clear()
    digests.update(new)
    return _global_updates(staged)


def _stage(rec: CommitRecord, ref: PartRef, patch: Patch, state: Mapping[str, torch.Tensor],
           digests: Mapping[str, str], decoded: dict[str, SparseUpdate] | None = None,
           predicted: dict[str, str] | None = None) -> _Staged:
    """Check one part against the commit and the holder, and decode it (writes nothing);
    `decoded`: its updates decoded earlier against the same held bytes (prefetch), and
    `predicted`: the digests their writes give."""
    h = patch.header
    keys = {u.key for u in ref.units}
    if (h.base_version, h.target_version) != (rec.base_version, rec.version) or (
        (h.base_state_digest, h.target_state_digest) != (ref.base_state_digest, ref.state_digest)
    ) or not set(h.tensors) <= keys:
        raise ProtocolError(
            f"part {ref.key} takes {h.base_version}->{h.target_version} over {len(h.tensors)} tensor(s) "
            f"(states {h.base_state_digest}->{h.target_state_digest}), but its commit says "
            f"{rec.base_version}->{rec.version} over its units (states {ref.base_state_digest}->{ref.state_digest})"
        )
    for u in ref.units:
        if u.name not in state:
            raise PatchMismatchError(f"part {ref.key} covers tensor {u.name!r}, which the holder lacks",
                                     hint="hold the run's whole key set, or pass names= to apply only some tensors")
    views = {u.key: unit_view(state, u) for u in ref.units}
    held = {u.key: held_digest(digests, state, u, algo_of(ref.base_state_digest)) for u in ref.units}
    if state_digest(held) != ref.base_state_digest:
        raise PatchMismatchError(
            f"part {ref.key} applies to units with state {ref.base_state_digest}, but the weights held are "
            f"{state_digest(held)}",
            hint="the holder is not at the part's base version; reload from an anchor",
        )
    # the held digests were checked above; a prefetched decode read these same bytes (the holder
    # has not moved since: same base version, and its verified digests match the part's base)
    updates = decoded if decoded is not None else decode_patch(patch, views, check_base_digest=False)
    targets = {**held, **{n: e.target_digest for n, e in h.tensors.items()}}
    if state_digest(targets) != ref.state_digest:
        raise DigestMismatchError(
            f"part {ref.key}: its tensors' target digests do not make up its state {ref.state_digest}",
            hint="the part is corrupt; fetch it again or reload from an anchor",
        )
    return _Staged(ref, views, updates, targets, predicted if decoded is not None else None)


def _global_updates(staged: Sequence[_Staged]) -> dict[str, SparseUpdate]:
    """Updates by tensor name with flat indices in the whole tensor (row ranges offset, joined)."""
    pieces: dict[str, list[tuple[int, SparseUpdate]]] = {}
    for s in staged:
        for u in s.ref.units:
            upd = s.updates.get(u.key)
            if upd is None:
                continue
            start = 0 if u.rows is None else u.rows[0]
            row = s.views[u.key][0].numel() if u.rows is not None and s.views[u.key].dim() > 0 else 0
            shift = start * row  # 0 for whole tensors and first row ranges: no copy of their indices
            pieces.setdefault(u.name, []).append(
                (start, SparseUpdate(upd.indices + shift, upd.values) if shift else upd)
            )
    out = {}
    for name, ps in pieces.items():
        ps.sort(key=lambda p: p[0])
        out[name] = (
            ps[0][1]
            if len(ps) == 1
            else SparseUpdate(torch.cat([p.indices for _, p in ps]), torch.cat([p.values for _, p in ps]))
        )
    return out
