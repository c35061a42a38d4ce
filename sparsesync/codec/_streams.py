"""The streams of one tensor's coding: what a coder may use (`Ctx`), zstd frames and the rANS
entropy coder (spec: docs/format.md, "Streams" and "Entropy coding").

Guarantee: every decoder here returns exactly the size the header implies or raises
PatchFormatError naming the tensor and the stream; a zstd frame is never inflated past the
size it must have, whatever window or content size a hostile frame declares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from sparsesync.codec import _native
from sparsesync.codec._classes import offsets
from sparsesync.errors import PatchFormatError

_MAX_WINDOW = 1 << 27  # zstd window a hostile frame may ask for (our frames use far less)
MAX_CLASSES = 8  # classes of the base magnitude a patch may condition on
MAX_ALPHABET = 64  # direct symbols of an entropy-coded stream; larger values escape to a raw stream
MAX_K = 48  # Rice-style remainder bits

StreamOut = tuple[str, tuple[int, ...], bytes]  # (safetensors dtype, shape, bytes)


@dataclass
class Ctx:
    """What encoders/decoders of one tensor may use."""

    name: str  # tensor name, for messages
    st_dtype: str  # the tensor's safetensors dtype name
    np_bits: np.dtype  # unsigned dtype of one element's bits
    numel: int
    n_changed: int
    # base bits at indices (None: whole tensor); None: no base (encoding)
    base_bits: Callable[[np.ndarray | None], np.ndarray] | None
    format_version: int = 2  # of the patch being read: picks the entropy decoder
    # (positions, the base bits there) when the positions decoder read them on its way (class-
    # conditioned gaps): `base` of that same array returns them without a second gather
    base_at_positions: tuple[np.ndarray, np.ndarray] | None = None

    def base(self, idx: np.ndarray | None) -> np.ndarray:
        """The base bits at `idx` (None: the whole tensor); only a decoder reading against a base asks."""
        if self.base_bits is None:
            raise format_error(self, "its coding is conditioned on the base, and no base was given")
        if idx is not None and self.base_at_positions is not None and self.base_at_positions[0] is idx:
            return self.base_at_positions[1]  # gathered by the positions decoder in its pass
        return self.base_bits(idx)


# ---------------------------------------------------------------------------- helpers
def zstd_compress(data: bytes | np.ndarray, level: int = 3) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(
        data if isinstance(data, bytes) else data.tobytes()
    )


def zstd_decompress(ctx: Ctx, role: str, data: bytes, expected: int) -> bytes:
    """Inflate one zstd frame of exactly `expected` bytes; anything else is PatchFormatError."""
    where = f"tensor '{ctx.name}': stream '{role}'"
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise PatchFormatError(
            f"{where}: not a zstd frame ({e})", hint="the patch is corrupt; fetch it again"
        ) from None
    if params.content_size != expected:
        raise PatchFormatError(
            f"{where}: declares {params.content_size} decompressed bytes, expected {expected}",
            hint="the patch is corrupt; fetch it again",
        )
    try:
        out = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW).decompress(
            data, max_output_size=expected, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise PatchFormatError(
            f"{where}: zstd frame does not decode ({e})", hint="the patch is corrupt; fetch it again"
        ) from None
    if len(out) != expected:
        raise PatchFormatError(
            f"{where}: decompressed to {len(out)} bytes, expected {expected}",
            hint="the patch is corrupt; fetch it again",
        )
    return out


def format_error(ctx: Ctx, msg: str) -> PatchFormatError:
    return PatchFormatError(
        f"tensor '{ctx.name}': {msg}", hint="the patch is corrupt or was written by a buggy encoder; fetch it again"
    )


def check_indices(ctx: Ctx, idx: np.ndarray) -> np.ndarray:
    """Require `n_changed` strictly increasing indices in [0, numel)."""
    if idx.size != ctx.n_changed:
        raise format_error(ctx, f"{idx.size} positions decoded, expected n_changed={ctx.n_changed}")
    if idx.size:
        if idx[0] < 0 or idx[-1] >= ctx.numel:
            bad = int(idx[0]) if idx[0] < 0 else int(idx[-1])
            raise format_error(ctx, f"index {bad} out of range, expected 0 <= index < {ctx.numel}")
        d = np.diff(idx)
        if d.size and d.min() <= 0:
            k = int(np.argmax(d <= 0))
            raise format_error(
                ctx, f"indices not strictly increasing: {int(idx[k])} then {int(idx[k + 1])} at position {k + 1}"
            )
    return idx


# ---------------------------------------------------------------------------- entropy coding
# Format 2: rANS in C (`_native.rans_encode` / `rans_decode`, GIL released, 4 interleaved
# states); format 1 (read only): constriction's AnsCoder. Spec: docs/format.md, "Entropy coding".
_RANS_STATUS = {
    1: "has {n} bytes, expected 0, or 32 plus a multiple of 4",
    2: "starts with an invalid coder state",
    3: "ends before its last symbol",
    4: "has data left after the last symbol",
    5: "has no model (all counts 0) for symbols it codes",
}


def check_counts(ctx: Ctx, counts: object, what: str) -> list[int]:
    if (
        not isinstance(counts, list)
        or not 2 <= len(counts) <= MAX_ALPHABET + 1
        or not all(type(c) is int and 0 <= c < 1 << 40 for c in counts)
    ):
        raise format_error(
            ctx, f"{what} symbol counts {counts!r:.80}, expected 2..{MAX_ALPHABET + 1} non-negative integers"
        )
    return counts


def escape_costs(hists: np.ndarray, raw_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `hists` (histograms of values clipped at MAX_ALPHABET, shape (rows, 65)):
    (estimated bits, alphabet size E in {1, 2, 4, ..., 64}) minimizing entropy + raw escapes +
    header (one C pass, `_native.escape_costs`)."""
    hists = np.ascontiguousarray(hists, dtype=np.int64)
    bits, es = np.empty(hists.shape[0]), np.empty(hists.shape[0], dtype=np.int64)
    _native.escape_costs(hists, float(raw_bits), bits, es)
    return bits, es


def _models(models: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts of every segment concatenated, their offsets, the segments' symbol offsets)."""
    counts = np.array([c for cs, _ in models for c in cs], dtype=np.int64)
    return counts, offsets([len(cs) for cs, _ in models]), offsets([n for _, n in models])


def ans_encode(sym: np.ndarray, models: list[tuple[list[int], int]]) -> bytes:
    """Entropy-code the int32 symbols `sym`: consecutive segments of n symbols, each with its
    own model `counts` (its exact symbol counts), per (counts, n) of `models`; `ans_decode`
    returns the segments in this order."""
    counts, cofs, sofs = _models(models)
    return _native.rans_encode(np.ascontiguousarray(sym, dtype=np.int32), sofs, counts, cofs)


def ans_decode(ctx: Ctx, role: str, data: bytes, models: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray]:
    """The symbols of stream `role`, as `ans_encode` took them: (every segment's int32 symbols
    end to end, segment offsets), one segment per (counts, n) of `models`, in order.
    Anything that does not decode exactly (and to the end) is PatchFormatError."""
    counts, cofs, sofs = _models(models)
    if ctx.format_version == 1:
        return _ans_decode_v1(ctx, role, data, models), sofs
    out = np.empty(int(sofs[-1]), dtype=np.int32)
    status = _native.rans_decode(data, counts, cofs, sofs, out)
    if status:
        raise format_error(ctx, f"stream '{role}' " + _RANS_STATUS[status].format(n=len(data)))
    return out, sofs


def _ans_decode_v1(ctx: Ctx, role: str, data: bytes, models: list[tuple[list[int], int]]) -> np.ndarray:
    """Format 1: constriction's AnsCoder (32-bit words) with its leaky 24-bit Categorical models."""
    import constriction

    if len(data) % 4:
        raise format_error(ctx, f"stream '{role}' has {len(data)} bytes, expected a multiple of 4")
    try:
        # an empty stream is the coder's initial state: certain symbols encode to nothing
        coder = constriction.stream.stack.AnsCoder(np.frombuffer(data, dtype="<u4").astype(np.uint32))
    except Exception as e:  # constriction rejects malformed data with ValueError
        raise format_error(ctx, f"stream '{role}' is not valid ANS data ({e})") from None
    out = []
    for counts, n in models:
        if n == 0:
            out.append(np.zeros(0, dtype=np.int32))
            continue
        if sum(counts) == 0:
            raise format_error(ctx, f"stream '{role}' has no model or data for {n} coded symbols")
        c = np.asarray(counts, dtype=np.float64)
        try:
            sym = np.asarray(
                coder.decode(constriction.stream.model.Categorical(c / c.sum(), perfect=False), n), dtype=np.int32
            )
        except Exception as e:
            raise format_error(ctx, f"stream '{role}' does not decode ({e})") from None
        if sym.size != n or (sym.size and (sym.min() < 0 or sym.max() >= len(counts))):
            raise format_error(ctx, f"stream '{role}' decoded to symbols outside the model")
        out.append(sym)
    if not coder.is_empty():
        raise format_error(ctx, f"stream '{role}' has data left after the last symbol")
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)
