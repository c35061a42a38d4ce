"""Change extraction in torch operations, on the device the tensors live on (no host copy of them).

What `device_snapshot.DeviceSnapshot` runs on a GPU (and, in tests, the same code on CPU tensors):
bitwise comparison of a base and a target tensor, counting, compaction of the changed elements
to buffers of a size known in advance (`torch.nonzero_static`: no device synchronization), the
magnitude keys and class ranks the size encoder reads of the base (`prepared_base`), and the
packing of every result of one publish into one flat byte buffer.

The one door to the host: every device->host read of this path goes through `to_host`, which
counts them (`reads()`), so a test can check that a publish reads a constant number of times,
whatever the number of tensors. A read of a CUDA tensor lands in pinned host memory.

Guarantees: `changed_mask` marks an element iff its bit pattern changed (NaN payloads, -0.0);
`compact` returns the changed flat indices in increasing order with their base and target bits;
`class_ranks` equals `_classes.class_ranks` (the C pass) for the same base, thresholds and
indices; `keys` equals the C codec's 7-bit magnitude key (the top byte of each element, sign
dropped).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from sparsesync.codec.blocks_digest import BLOCK, n_blocks
from sparsesync.codec.device_blocks import block_digests_device
from sparsesync.codec.diff import bits_view
from sparsesync.codec.prepared_base import hist_sample

_READS = threading.local()
HIST_CHUNK = 1 << 24  # elements whose keys are histogrammed at once (bounds the int64 temporaries)
# 64 KiB blocks per call of the digest (256 MiB: about 1.3 GB of temporaries on the device). Each
# call builds its constant tensors afresh, host->device copies that wait for the device on CUDA:
# fewer, larger calls keep those waits to about one per 256 MiB (not counted by `reads`). Where the
# Triton kernel hashes CUDA tensors (`device_blocks`), it has no such per-call copies
DIGEST_CHUNK_BLOCKS = 4096


def reads() -> int:
    """Device->host reads `to_host` made so far on this thread."""
    return int(getattr(_READS, "n", 0))


def to_host(t: torch.Tensor) -> np.ndarray:
    """`t` (any device, contiguous) as a host numpy array of the same dtype: the one device->host
    read of the device path, counted (`reads`). A CUDA tensor is copied into pinned memory,
    then the stream is synchronized once."""
    _READS.n = reads() + 1
    t = t.detach().contiguous()
    if t.device.type == "cpu":
        return t.numpy().copy()  # the caller owns it (the device buffer may be reused)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t, non_blocking=True)
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    return host.numpy()


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements' bits as a flat signed int tensor on its device (C order; a copy only for
    a non-contiguous view)."""
    return bits_view(t)


def changed_mask(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bool per element: its bits differ (the integer views compared: one read of each side;
    on a GPU a word-level pass first would read them twice)."""
    return a != b


def keys(bits: torch.Tensor) -> torch.Tensor:
    """The 7-bit magnitude key of each element (uint8): the top byte, sign dropped."""
    shift = 8 * (bits.element_size() - 1)
    return ((bits >> shift) & 0x7F).to(torch.uint8)


def key_hist(k: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """int64[128] on the device: how many elements have each key (with `weight` (bool): only
    those where it is set), without a device synchronization (no bincount)."""
    out = torch.zeros(128, dtype=torch.int64, device=k.device)
    for s in range(0, k.numel(), HIST_CHUNK):
        ks = k[s : s + HIST_CHUNK].long()
        w = torch.ones_like(ks) if weight is None else weight[s : s + HIST_CHUNK].long()
        out.scatter_add_(0, ks, w)
    return out


def sample_hist(a: torch.Tensor, sample: int) -> torch.Tensor:
    """The key histogram of the sample the encoder chooses thresholds from (`prepared_base.hist_sample`)."""
    starts, block = hist_sample(a.numel(), sample)
    return key_hist(keys(torch.cat([a[int(s) : int(s) + block] for s in starts])))


def compact(a: torch.Tensor, b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices int64, base bits, target bits) of the `n` changed elements, in index order, on
    the device (`n` from a count read before: no synchronization here)."""
    idx = torch.nonzero_static(changed_mask(a, b), size=n).reshape(-1)
    return idx, a[idx], b[idx]


def class_ranks(a: torch.Tensor, thresholds: Sequence[int], idx: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """int64: the rank of each changed element among the members of its class in the base `a`,
    class 0's first (index order inside a class), as `_classes.class_ranks` concatenates them;
    `sizes`: how many of `idx` each class holds (known from the changed keys' histogram)."""
    k = keys(a)
    cls = torch.zeros_like(k)
    for t in thresholds:  # the class: how many thresholds the key reaches (no host->device copy)
        cls += k >= t
    at = cls[idx]
    count_dtype = torch.int32 if a.numel() < 1 << 31 else torch.int64
    out = []
    for c, size in enumerate(sizes):
        member = cls == c
        before = torch.cumsum(member, 0, dtype=count_dtype)  # members up to and including each element
        pos = torch.nonzero_static(at == c, size=size).reshape(-1)
        out.append(before[idx[pos]].long() - 1)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64, device=a.device)


def block_digests_many(tensors: Sequence[torch.Tensor], batch_bytes: int = 256 << 20) -> list[torch.Tensor]:
    """`device_blocks.block_digests_device` of each tensor (int64 per 64 KiB block, on its
    device), with tensors smaller than `batch_bytes` laid end to end, each zero-padded to whole
    blocks (as the digest pads a tensor's last block), and hashed in one call per batch: the
    per-call work of the digest does not repeat per tensor. A larger tensor is hashed alone."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    batch: list[int] = []
    batch_at = 0

    def flush() -> None:
        nonlocal batch, batch_at
        if not batch:
            return
        dev = tensors[batch[0]].device
        buf = torch.zeros(batch_at, dtype=torch.uint8, device=dev)
        at = 0
        spans = []
        for i in batch:
            raw = tensors[i].detach().contiguous().reshape(-1).view(torch.uint8)
            buf[at : at + raw.numel()] = raw
            spans.append((i, at // BLOCK, n_blocks(raw.numel())))
            at += n_blocks(raw.numel()) * BLOCK
        digests = block_digests_device(buf, DIGEST_CHUNK_BLOCKS)
        for i, first, count in spans:
            out[i] = digests[first : first + count]
        batch, batch_at = [], 0

    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if nbytes >= batch_bytes:
            out[i] = block_digests_device(t, DIGEST_CHUNK_BLOCKS)
            continue
        if batch_at + n_blocks(nbytes) * BLOCK > batch_bytes:
            flush()
        batch.append(i)
        batch_at += n_blocks(nbytes) * BLOCK
    flush()
    return [d if d is not None else torch.empty(0, dtype=torch.int64) for d in out]


class Packer:
    """Tensors of one publish laid end to end in one byte buffer on the device (each at an
    8-byte boundary), read back with one `to_host`; `read` gives each as numpy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[torch.Tensor] = []
        self._spans: list[tuple[int, int, torch.dtype, int, bool]] = []  # (offset, nbytes, dtype, numel, bits)
        self._at = 0

    def add(self, t: torch.Tensor, *, bits: bool = False) -> int:
        """Queue `t` (flat, on the device; not copied: it must not change before `read`); its
        index in `read`'s list. `bits`: element bits, read back as unsigned ints of their width."""
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        nbytes = raw.numel()
        pad = -nbytes % 8
        self._parts.append(raw)
        if pad:
            self._parts.append(torch.zeros(pad, dtype=torch.uint8, device=self.device))
        self._spans.append((self._at, nbytes, t.dtype, t.numel(), bits))
        self._at += nbytes + pad
        return len(self._spans) - 1

    def read(self) -> list[np.ndarray]:
        """One device->host read of everything added; each tensor as numpy (unsigned bits for
        the int views, views of one host buffer)."""
        host = to_host(torch.cat(self._parts)) if self._parts else np.empty(0, dtype=np.uint8)
        out = []
        for off, nbytes, dtype, numel, bits in self._spans:
            npd = np.dtype(f"u{dtype.itemsize}") if bits else torch.empty(0, dtype=dtype).numpy().dtype
            out.append(host[off : off + nbytes].view(npd)[:numel])
        return out
