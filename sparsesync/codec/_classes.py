"""Classes of the base magnitude, and rank/select over packed bitmaps (used by `gaps`/`delta`).

Guarantee: encoder and decoder compute the same classes from the same base bits, so the class
of an element costs nothing to send; `RankSelect.select(RankSelect.rank(i)) == i` for every
member i of a bitmap. Everything is vectorized numpy; the full-tensor passes run in
cache-sized chunks on the codec's thread pool. See docs/format.md, "Classes of the base
magnitude".
"""

from __future__ import annotations

import numpy as np

from sparsesync.codec import _parallel


# Elements are grouped by the magnitude of their base value: key = top 7 magnitude bits (for
# bf16/fp32 the top 7 exponent bits, for fp16 5 exponent + 2 mantissa bits, for fp8 all of it).
# Thresholds t_1 < ... < t_{K-1} in [1, 127] split keys into K classes: class c holds keys in
# [t_c, t_{c+1}). Both sides compute class bitmaps from the base; the canonical order inside a
# class is the flat order.

_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
_SEL8 = np.zeros((256, 8), dtype=np.uint8)
for _v in range(256):
    _bits = [b for b in range(8) if _v >> b & 1]
    _SEL8[_v, : len(_bits)] = _bits
_POOL_CHUNK = 1 << 20  # elements per worker task when building masks (temporaries stay in cache)


def _top_byte(bits: np.ndarray) -> np.ndarray:
    """The most significant byte of each element's bits (uint8; sign bit included)."""
    w = bits.dtype.itemsize
    if w == 1:
        return bits.view(np.uint8)
    return np.ascontiguousarray(bits).view(np.uint8)[w - 1 :: w]  # little-endian: the last byte


def key_of(bits: np.ndarray) -> np.ndarray:
    """The 7-bit magnitude key of each element's bits (uint8)."""
    return _top_byte(bits) & np.uint8(0x7F)


def class_of(bits: np.ndarray, thresholds: list[int]) -> np.ndarray:
    """Class index of each element (uint8) for the given thresholds."""
    lut = np.searchsorted(np.asarray(thresholds, dtype=np.int64), np.arange(256) & 0x7F, side="right").astype(np.uint8)
    return lut[_top_byte(bits)]


def _below_masks_chunk(bits: np.ndarray, limits: list[int], out: list[np.ndarray], start: int) -> None:
    mag2 = np.left_shift(bits, bits.dtype.type(1))  # drops the sign bit: 2 * magnitude
    for lim, o in zip(limits, out):
        o[start // 8 : start // 8 + (bits.size + 7) // 8] = np.packbits(mag2 < bits.dtype.type(lim), bitorder="little")


def class_bitmaps(base: np.ndarray, thresholds: list[int]) -> list[np.ndarray]:
    """Per class, a packed little-endian bitmap (uint64 words) of its members in `base`."""
    n = base.size
    w = base.dtype.itemsize
    nbytes = (n + 63) // 64 * 8
    limits = [t << (8 * w - 7) for t in thresholds]  # key < t  <=>  2 * magnitude < t << (8w - 7)
    below = [np.zeros(nbytes, dtype=np.uint8) for _ in limits]
    if limits:
        step = _POOL_CHUNK
        _parallel.map_ordered(lambda s: _below_masks_chunk(base[s : s + step], limits, below, s), range(0, n, step), "chunks")
    valid = np.zeros(nbytes, dtype=np.uint8)
    valid[: n // 8] = 0xFF
    if n % 8:
        valid[n // 8] = (1 << (n % 8)) - 1
    words = [b.view("<u8") for b in below] + [valid.view("<u8")]
    out, prev = [], None
    for cur in words:  # class c = below(t_{c+1}) & ~below(t_c)
        out.append(cur if prev is None else cur & ~prev)
        prev = cur
    return out


class RankSelect:
    """Rank and select over a packed bitmap of uint64 words."""

    def __init__(self, words: np.ndarray) -> None:
        self.words = words
        self.pop = np.bitwise_count(words).astype(np.int64)
        self.cum = np.cumsum(self.pop)  # inclusive
        self.total = int(self.cum[-1]) if self.cum.size else 0

    def rank(self, i: np.ndarray) -> np.ndarray:
        """Number of set bits before each position in `i`."""
        wi = i >> 6
        low = (np.uint64(1) << (i & 63).astype(np.uint64)) - np.uint64(1)
        return self.cum[wi] - self.pop[wi] + np.bitwise_count(self.words[wi] & low).astype(np.int64)

    def select(self, r: np.ndarray) -> np.ndarray:
        """Position of the r-th set bit (0-based) for each r (all r < total). In-word select is
        SWAR: per-byte popcounts, their prefix sums by one multiply, the byte found by comparing
        all 8 prefix sums with k at once, then a 256 x 8 table."""
        wi = np.searchsorted(self.cum, r, side="right")
        k = (r - (self.cum[wi] - self.pop[wi])).astype(np.uint64)  # rank inside the word, 0..63
        w = self.words[wi]
        x = w - ((w >> _U1) & _M1)
        x = (x & _M2) + ((x >> _U2) & _M2)
        x = (x + (x >> _U4)) & _M4  # popcount of each byte
        incl = x * _L8  # byte i: popcount of bytes 0..i (<= 64: no carries)
        le = ((k * _L8) | _H8) - incl  # byte i's top bit set iff incl_i <= k (no borrows: bytes < 128)
        j = np.bitwise_count(le & _H8).astype(np.uint64)  # the byte holding the bit
        sh = j * _U8
        before = ((incl << _U8) >> sh) & _FF
        byte = (w >> sh) & _FF
        return wi * 64 + (sh.astype(np.int64) + _SEL8[byte.astype(np.intp), (k - before).astype(np.intp)])


_U1, _U2, _U4, _U8 = (np.uint64(v) for v in (1, 2, 4, 8))
_M1, _M2, _M4 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333), np.uint64(0x0F0F0F0F0F0F0F0F)
_L8, _H8, _FF = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080), np.uint64(0xFF)
