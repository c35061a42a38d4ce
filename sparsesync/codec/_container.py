"""A strict, bounded reader and a deterministic writer of safetensors files (patch container).

Guarantee: `parse_container` either returns a table of streams that lie inside the buffer,
do not overlap, tile the data section exactly, and have sizes matching dtype x shape, or raises
PatchFormatError. It never allocates more than the buffer it was given plus the header.
`write_container` emits bytes that the `safetensors` library loads unchanged.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

from sparsesync.codec import _native
from sparsesync.errors import PatchFormatError

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_NDIM = 16
MAX_NUMEL = 1 << 48

# safetensors dtype name -> (torch dtype, element size in bytes)
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        ST_DTYPES[_name] = (getattr(torch, _attr), torch.empty((), dtype=getattr(torch, _attr)).element_size())
TORCH_TO_ST = {v[0]: k for k, v in ST_DTYPES.items()}


def st_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ('BF16' for torch.bfloat16)."""
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise PatchFormatError(
            f"dtype {dtype} has no safetensors name", hint=f"use one of {sorted(TORCH_TO_ST.values())}"
        ) from None


@dataclass(frozen=True)
class Stream:
    """One tensor of the container: where its bytes lie in the buffer."""

    key: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the buffer
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def header_length(first8: bytes) -> int:
    """The JSON header length declared by a safetensors file's first 8 bytes (little-endian u64)."""
    if len(first8) < 8:
        raise PatchFormatError(
            f"file starts with {len(first8)} bytes, expected at least 8 (the header length)",
            hint="the file is truncated; fetch it again",
        )
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n > MAX_HEADER_BYTES:
        raise PatchFormatError(
            f"declared header length {n} B, expected at most {MAX_HEADER_BYTES} B",
            hint="the file is not a safetensors file or is corrupt",
        )
    return n


def parse_header_json(header_bytes: bytes) -> tuple[dict[str, str], dict[str, dict]]:
    """The `__metadata__` (str -> str) and the raw tensor table of a safetensors header."""
    try:
        obj = json.loads(bytes(header_bytes).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON syntax, ints over 4300 digits
        raise PatchFormatError(
            f"header is not UTF-8 JSON: {type(e).__name__}: {str(e):.200}",
            hint="the file is corrupt or not a safetensors file",
        ) from None
    if not isinstance(obj, dict):
        raise PatchFormatError(f"header is a JSON {type(obj).__name__}, expected an object", hint="the file is corrupt")
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise PatchFormatError("header __metadata__ is not a map of strings to strings", hint="the file is corrupt")
    return meta, obj


def _int_list(v: object, what: str) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise PatchFormatError(f"{what} is {v!r:.80}, expected a list of integers", hint="the file is corrupt")
    return v


def parse_streams(table: dict[str, dict], data_start: int, data_len: int) -> dict[str, Stream]:
    """Validate the tensor table against a data section of `data_len` bytes at `data_start`."""
    streams: dict[str, Stream] = {}
    for key, info in table.items():
        if not isinstance(info, dict):
            raise PatchFormatError(
                f"stream '{key}': entry is {type(info).__name__}, expected an object", hint="the file is corrupt"
            )
        dtype = info.get("dtype")
        if dtype not in ST_DTYPES:
            raise PatchFormatError(
                f"stream '{key}': dtype {dtype!r}, expected one of {sorted(ST_DTYPES)}", hint="the file is corrupt"
            )
        shape = _int_list(info.get("shape"), f"stream '{key}': shape")
        offs = _int_list(info.get("data_offsets"), f"stream '{key}': data_offsets")
        if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise PatchFormatError(
                f"stream '{key}': shape {shape}, expected at most {MAX_NDIM} non-negative dims",
                hint="the file is corrupt",
            )
        if len(offs) != 2 or not 0 <= offs[0] <= offs[1] <= data_len:
            raise PatchFormatError(
                f"stream '{key}': data_offsets {offs}, expected [start, end] within the {data_len}-byte data section",
                hint="the file is truncated or corrupt",
            )
        numel = 1
        for d in shape:
            numel *= d
            if numel > MAX_NUMEL:
                raise PatchFormatError(
                    f"stream '{key}': shape {shape} declares more than {MAX_NUMEL} elements", hint="the file is corrupt"
                )
        if numel * ST_DTYPES[dtype][1] != offs[1] - offs[0]:
            raise PatchFormatError(
                f"stream '{key}': {offs[1] - offs[0]} bytes, expected {numel * ST_DTYPES[dtype][1]} for {dtype} "
                f"{shape}",
                hint="the file is corrupt",
            )
        streams[key] = Stream(key, dtype, tuple(shape), data_start + offs[0], data_start + offs[1])
    pos = data_start
    for s in sorted(streams.values(), key=lambda s: (s.start, s.end)):
        if s.start != pos:
            raise PatchFormatError(
                f"stream '{s.key}': starts at data byte {s.start - data_start}, expected {pos - data_start} (streams "
                "must tile the data section)",
                hint="the file is corrupt",
            )
        pos = s.end
    if pos != data_start + data_len:
        raise PatchFormatError(
            f"data section is {data_len} bytes, streams cover {pos - data_start}",
            hint="the file is truncated or has trailing bytes",
        )
    return streams


def parse_container(buf: memoryview) -> tuple[dict[str, str], dict[str, Stream]]:
    """Parse a whole safetensors buffer: metadata and validated stream table."""
    n = header_length(bytes(buf[:8]))
    if 8 + n > len(buf):
        raise PatchFormatError(
            f"declared header length {n} B, but the file has {len(buf) - 8} B after the length",
            hint="the file is truncated; fetch it again",
        )
    meta, table = parse_header_json(bytes(buf[8 : 8 + n]))
    return meta, parse_streams(table, 8 + n, len(buf) - 8 - n)


def write_container(
    metadata: dict[str, str], streams: list[tuple[str, str, tuple[int, ...], bytes | list[bytes]]]
) -> bytes:
    """A safetensors file: `streams` are (key, safetensors dtype, shape, raw bytes or a list of
    pieces that make them up), written widest dtype first (keeps every stream aligned to its
    element size), then in the order given. The file is built in one copy (`_native.join`)."""
    order = sorted(range(len(streams)), key=lambda i: -ST_DTYPES[streams[i][1]][1])
    header: dict[str, object] = {"__metadata__": metadata}
    pieces: list[bytes] = []
    off = 0
    for i in order:
        key, dtype, shape, data = streams[i]
        parts = data if isinstance(data, list) else [data]
        size = sum(len(p) for p in parts)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + size]}
        pieces += parts
        off += size
    hbytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    return _native.join([struct.pack("<Q", len(hbytes)), hbytes, *pieces])


def stream_array(buf: memoryview, s: Stream, np_dtype: np.dtype) -> np.ndarray:
    """A stream's bytes as a (copied, aligned) 1-D numpy array of `np_dtype`."""
    return np.frombuffer(buf[s.start : s.end], dtype=np.uint8).copy().view(np_dtype)
