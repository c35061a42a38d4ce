"""The writer's copy of the last published version kept where the weights are (a GPU), and the
extraction of a version's changes there with a constant number of device->host reads.

`DeviceSnapshot.extract(current, v)` compares each tensor's bits with the snapshot on the
weights' device, counts the changes of every tensor, and reads all counts (and the key
histograms the size encoder needs) back in ONE read; then it compacts the changed elements'
indices and base/target bits (sizes now known: no further synchronization), prepares what the
encoder reads of the base (class ranks; the whole base only for a change of at least 1/4 of a
tensor: `prepared_base`), computes the touched tensors' "xxh3b" block digests, and reads all of
that back in ONE more read (`device_changes.to_host`, pinned memory on CUDA). Two reads per
publish, whatever the number of tensors. The small tensors a CPU `Snapshot` groups
(`_groups.plan_groups`) are kept on the host instead (`device_groups`): their current bits come
back packed in the first read and are diffed and coded there, in groups. Only then does the
snapshot advance (in place: the changed elements). The returned `Extracted` holds host copies
only, so the caller's weights may change at once; `Extracted.encode()` (entropy coding, on any
thread) makes the same patch bytes as a CPU `Snapshot.diff_encode` makes for the same states,
groups included.

Placement (`Placement`): "device": the copy on the weights' device (2 B/param for bf16 of GPU
memory); "host": in host memory (pinned on CUDA), each tensor brought to the weights' device to
be compared (the model crosses PCIe once per pass, two passes per publish) and advanced on the
host. `placement_for` picks "device" when the model fits twice in the GPU's free memory.

Guarantees: after `extract`, the snapshot holds `current`'s bits and `.digests` its digests;
if anything fails before the reads complete or while the grouped tensors advance, the snapshot
(both halves) is left as it was. Only the "xxh3b"
digest (`DEFAULT_ALGO`) is computed on the device; a run with another digest keeps `Snapshot`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from sparsesync.codec import _parallel
from sparsesync.codec._classes import class_sizes
from sparsesync.codec._select import _HIST_SAMPLE, MIN_CLASSED_NUMEL
from sparsesync.codec.blocks_digest import combine
from sparsesync.codec.cast import layout, owned_copy
from sparsesync.codec.device_changes import (
    Packer,
    block_digests_many,
    class_ranks,
    compact,
    flat_bits,
    key_hist,
    keys,
    sample_hist,
)
from sparsesync.codec.device_groups import HostGroups, SmallChanges
from sparsesync.codec.diff import TensorChange, put_bits, to_np_bits
from sparsesync.codec.digest import BLOCKS_ALGO, state_digest
from sparsesync.codec.patch import Effort, assemble_patch, check_effort, encode_tensors
from sparsesync.codec.prepared_base import PreparedBase, thresholds_from_hist
from sparsesync.codec.snapshot import EncodedPatch, PatchStats
from sparsesync.errors import PatchMismatchError

Placement = Literal["device", "host"]


def placement_for(state: Mapping[str, torch.Tensor]) -> Placement:
    """"device" when the state fits twice in its GPU's free memory (`torch.cuda.mem_get_info`),
    else "host"; "device" for weights on any other non-CUDA device."""
    dev = weights_device(state)
    if dev.type != "cuda":
        return "device"
    free, _total = torch.cuda.mem_get_info(dev)
    return placement_of(sum(layout(state, n)[2].numel() * layout(state, n)[1].itemsize for n in state), free)


def placement_of(model_bytes: int, free_bytes: int) -> Placement:
    """"device" when a model of `model_bytes` fits twice in `free_bytes` of device memory (its
    snapshot beside it, and room for the passes' temporaries), else "host"."""
    return "device" if 2 * model_bytes <= free_bytes else "host"


def weights_device(state: Mapping[str, torch.Tensor]) -> torch.device:
    """The one device every tensor of `state` lives on (ValueError naming two that differ)."""
    devices = {layout(state, n)[0] for n in state}
    if len(devices) > 1:
        raise ValueError(f"the state's tensors live on several devices: {sorted(map(str, devices))}")
    return next(iter(devices)) if devices else torch.device("cpu")


BATCH_BYTES = 256 << 20  # target bytes hashed in one batch (`device_changes.block_digests_many`)


@dataclass
class _Plan:
    """One changed tensor's entries in the publish's read (`Packer` indices; None: not read)."""

    indices: int
    base: int
    target: int
    blocks: int = -1
    ranks: int | None = None
    full: int | None = None
    hist: np.ndarray | None = None
    thresholds: list[int] = field(default_factory=list)


@dataclass
class Extracted:
    """One version's changes, read back to host memory: everything `encode` needs."""

    changes: dict[str, TensorChange]
    prepared: dict[str, PreparedBase]
    base_version: int
    target_version: int
    base_digests: dict[str, str]
    target_digests: dict[str, str]
    base_state_digest: str
    target_state_digest: str
    n_params: int
    effort: Effort
    diff_s: float  # seconds of device work and reads (the publisher's stall)
    small: SmallChanges = field(default_factory=SmallChanges)  # the grouped tensors' part (`device_groups`)

    def encode(self) -> EncodedPatch:
        """The patch (entropy coding on the host; any thread)."""
        t0 = time.perf_counter()
        own = {n: c for n, c in self.changes.items() if n in self.prepared}  # the rest: the groups' members
        encoded = encode_tensors(own, base=self.prepared, effort=self.effort)
        alone, groups = self.small.encode(self.effort)
        encoded = dict(sorted({**encoded, **alone}.items()))
        data = assemble_patch(encoded, base_version=self.base_version, target_version=self.target_version,
                              base_digests=self.base_digests, target_digests=self.target_digests,
                              base_state_digest=self.base_state_digest, target_state_digest=self.target_state_digest,
                              groups=groups)
        n_changed = sum(c.n_changed for c in self.changes.values())
        stats = PatchStats(n_params=self.n_params, n_changed=n_changed,
                           density=n_changed / self.n_params if self.n_params else 0.0, patch_bytes=len(data),
                           bytes_per_changed=len(data) / n_changed if n_changed else 0.0, diff_s=self.diff_s,
                           encode_s=time.perf_counter() - t0)
        return EncodedPatch(data, self.changes, self.base_version, self.target_version, self.base_state_digest,
                            self.target_state_digest, dict(self.target_digests), stats)


class DeviceSnapshot:
    """A full copy of the last published version beside the weights (see the module docstring)."""

    def __init__(self, state: Mapping[str, torch.Tensor], version: int, *, placement: Placement = "device",
                 effort: Effort = "size", algo: str = BLOCKS_ALGO) -> None:
        if algo != BLOCKS_ALGO:
            raise ValueError(f"a device snapshot digests with {BLOCKS_ALGO!r}, not {algo!r}")
        if placement not in ("device", "host"):
            raise ValueError(f"placement={placement!r}, expected 'device' or 'host'")
        self.device = weights_device(state)  # where tensors are compared
        self.placement: Placement = placement
        self.effort, self.version, self.algo = check_effort(effort), version, algo
        home = self.device if placement == "device" else torch.device("cpu")
        pin = placement == "host" and self.device.type == "cuda"
        self.small = HostGroups(state, algo)  # the tensors a CPU snapshot groups: on the host, grouped
        self.state: dict[str, torch.Tensor] = {}
        for n in state:
            if n in self.small.names:
                continue
            t = owned_copy(state, n, home)
            self.state[n] = t.pin_memory() if pin else t
        self.large = list(self.state)  # compared on the device
        self.state.update(self.small.views())
        self.state = {n: self.state[n] for n in state}
        self.digests: dict[str, str] = {**self._digests(), **self.small.digests()}
        self.digests = {n: self.digests[n] for n in state}
        self.state_digest: str = state_digest(self.digests)

    @property
    def where(self) -> str:
        """Where the copy lives: the device ("cuda:0"; "device:cpu" for CPU weights on this
        path, as tests run it), or "pinned"/"host" memory."""
        if self.placement == "device":
            return str(self.device) if self.device.type != "cpu" else "device:cpu"
        return "pinned" if self.device.type == "cuda" else "host"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def _digests(self) -> dict[str, str]:
        """The "xxh3b" digests of the snapshot's tensors, computed on the comparing device (a
        host copy brought over in batches of `BATCH_BYTES`), one read."""
        pk = Packer(self.device)
        handles: dict[str, int] = {}
        batch: dict[str, torch.Tensor] = {}

        def hash_batch() -> None:
            handles.update((n, pk.add(d)) for n, d in zip(batch, block_digests_many(list(batch.values()))))
            batch.clear()

        for n in self.large:
            batch[n] = self._base(n)
            if sum(t.numel() * t.element_size() for t in batch.values()) >= BATCH_BYTES:
                hash_batch()
        hash_batch()
        got = pk.read()
        return {n: combine(got[h].view(np.uint64), self.state[n].numel() * self.state[n].element_size())
                for n, h in handles.items()}

    def _base(self, name: str) -> torch.Tensor:
        """The snapshot tensor's bits on the comparing device (a host copy is brought over)."""
        return flat_bits(self.state[name]).to(self.device, non_blocking=True)

    def _target(self, current: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        """`current[name]`'s bits on the comparing device (a tensor elsewhere, e.g. a frozen one
        taken from a host snapshot, is brought over)."""
        return flat_bits(current[name]).to(self.device, non_blocking=self.device.type != "cpu")  # no async D2H

    def _check(self, current: Mapping[str, torch.Tensor]) -> None:
        problems = []
        if current.keys() != self.state.keys():
            problems.append(f"missing {sorted(set(self.state) - set(current))}, "
                            f"extra {sorted(set(current) - set(self.state))}")
        for n in sorted(set(current) & set(self.state)):
            _dev, dtype, shape, _ = layout(current, n)
            b = self.state[n]
            if dtype != b.dtype or tuple(shape) != tuple(b.shape):
                problems.append(f"tensor '{n}': {dtype} {tuple(shape)}, expected {b.dtype} {tuple(b.shape)}")
        if problems:
            raise PatchMismatchError("the state differs from the snapshot's layout: " + "; ".join(problems),
                                     hint="publish the same model on the same device every version")

    def _count(self, names: list[str], current: Mapping[str, torch.Tensor],
               size: bool) -> tuple[list[torch.Tensor], np.ndarray, list[np.ndarray]]:
        """Pass 1: per tensor its count of changes (and, for the size encoder, the key
        histograms its thresholds come from), and the grouped tensors' current bits (one
        buffer per group, `device_groups`), all read back in one read."""
        rows = []
        for n in names:
            a, b = self._base(n), self._target(current, n)
            m = a != b
            row = [m.sum().reshape(1)]
            if size and a.numel() >= MIN_CLASSED_NUMEL:
                row += [sample_hist(a, _HIST_SAMPLE), key_hist(keys(a), m)]
            rows.append(torch.cat(row))
        pk = Packer(self.device)
        at = pk.add(torch.cat(rows)) if rows else -1
        small = self.small.pack(current, self.device, pk)
        got = pk.read()
        return rows, (got[at] if rows else np.empty(0, dtype=np.int64)), [got[i] for i in small]

    def _advance(self, on_device: dict[str, tuple[torch.Tensor, torch.Tensor]], changes: dict[str, TensorChange],
                 digests: dict[str, str], small_bits: list[np.ndarray]) -> SmallChanges:
        """Move both halves of the snapshot to the version just read: the grouped tensors on the
        host (their changes and digests added to `changes`, `digests`), then the others; a failure
        puts the groups back."""
        small = self.small.advance(small_bits)  # raises with the groups as they were
        changes.update(small.changes)
        digests.update(small.digests)
        try:
            for n, (idx, tb) in on_device.items():
                if self.placement == "device":
                    flat_bits(self.state[n]).index_copy_(0, idx, tb)
                else:
                    put_bits(to_np_bits(flat_bits(self.state[n])), changes[n].indices, changes[n].target_bits)
        except BaseException:
            small.undo()
            raise
        return small

    def extract(self, current: Mapping[str, torch.Tensor], target_version: int) -> Extracted:
        """The changes from the snapshot's version to `current` (as `target_version`), read back
        in two reads; then the snapshot holds `current` (see the module docstring)."""
        t0 = time.perf_counter()
        self._check(current)
        names = self.large
        size = self.effort == "size"
        rows, counts, small_bits = self._count(names, current, size)
        # pass 2: compact the changed elements and what the encoder reads of the base, one read
        pk = Packer(self.device)
        on_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # indices, target bits: to advance
        plan: dict[str, _Plan] = {}
        targets: dict[str, torch.Tensor] = {}  # hashed in batches (a cast target is a temporary)

        def hash_targets() -> None:
            for name, d in zip(targets, block_digests_many(list(targets.values()))):
                plan[name].blocks = pk.add(d)
            targets.clear()

        off = 0
        for n, r in zip(names, rows):
            k, hist, chg = int(counts[off]), counts[off + 1 : off + 129], counts[off + 129 : off + 257]
            off += r.numel()
            if k == 0:
                continue
            a, b = self._base(n), self._target(current, n)
            numel = a.numel()
            idx, ba, tb = compact(a, b, k)
            on_device[n] = (idx, tb)
            p = plan[n] = _Plan(pk.add(idx), pk.add(ba, bits=True), pk.add(tb, bits=True))
            if size and numel >= MIN_CLASSED_NUMEL and 16 <= k < numel:  # classed, as `_select.choose` decides
                p.hist, p.thresholds = hist.copy(), thresholds_from_hist(hist, numel, chg, _HIST_SAMPLE)
                if p.thresholds:
                    p.ranks = pk.add(class_ranks(a, p.thresholds, idx, class_sizes(chg, p.thresholds)))
            if 4 * k >= numel:
                p.full = pk.add(a, bits=True)  # read before the snapshot advances
            targets[n] = b
            if sum(t.numel() * t.element_size() for t in targets.values()) >= BATCH_BYTES:
                hash_targets()
        hash_targets()  # the touched tensors' target digests (8 bytes per 64 KiB block come back)
        got = pk.read()
        changes, prepared, digests = {}, {}, dict(self.digests)
        for n, p in plan.items():
            t = self.state[n]
            changes[n] = TensorChange(t.dtype, tuple(t.shape), got[p.indices], got[p.base], got[p.target])
            prepared[n] = PreparedBase(t.numel(), p.hist, p.thresholds, None if p.ranks is None else got[p.ranks],
                                       None if p.full is None else got[p.full])
            digests[n] = combine(got[p.blocks].view(np.uint64), t.numel() * t.element_size())
        with _parallel.interrupts_deferred():  # a Ctrl-C waits: the snapshot moves whole
            small = self._advance(on_device, changes, digests, small_bits)
            base_digests, base_sd = self.digests, self.state_digest
            self.digests = digests
            self.state_digest = state_digest(digests) if changes else base_sd
            base_version, self.version = self.version, target_version
        n_params = sum(t.numel() for t in self.state.values())
        return Extracted(dict(sorted(changes.items())), prepared, base_version, target_version, base_digests,
                         dict(digests), base_sd, self.state_digest, n_params, self.effort,
                         time.perf_counter() - t0, small)
