"""The patch codec: bitwise change detection, the sparse patch format, and all-or-nothing apply.

Guarantees: `apply_patch(read_patch(encode_changes(diff_state(base, target))), base)` leaves
`base` equal to `target` bit for bit, for every dtype and bit pattern (NaN payloads, -0.0,
infinities, subnormals); a patch that does not fit, or a malformed file, raises before the
first byte of any tensor is written. The format is specified in docs/format.md.
"""

try:
    from sparsesync.codec import _native  # noqa: F401 - the C passes every codec module uses
except ImportError as e:  # a source tree that was never built
    raise ImportError(
        f"sparsesync's compiled codec (sparsesync/codec/_native.c) is not built ({e}). Install sparsesync with pip "
        "(`pip install -e .` in a checkout; it needs a C compiler), or compile it in place: python "
        "sparsesync/codec/_build.py"
    ) from None

from sparsesync.codec import device_apply as _device_apply  # noqa: F401 - registers apply_patch's device path
from sparsesync.codec._parallel import interrupts_deferred
from sparsesync.codec.anchor import AnchorInfo, load_anchor, write_anchor
from sparsesync.codec.apply import SparseUpdate, apply_patch, decode_patch, verify_digests
from sparsesync.codec.diff import TensorChange, compose_changes, diff_state
from sparsesync.codec.digest import DEFAULT_ALGO, algo_of, algos_of, state_digest, tensor_digest, tensor_digests
from sparsesync.codec.patch import Effort, Patch, PatchHeader, TensorEntry, encode_changes
from sparsesync.codec.patch_reader import fetch_header, header_length, header_span, parse_header, read_patch
from sparsesync.codec.snapshot import EncodedPatch, PatchStats, Snapshot

__all__ = [
    "DEFAULT_ALGO",
    "AnchorInfo",
    "Effort",
    "EncodedPatch",
    "Patch",
    "PatchHeader",
    "PatchStats",
    "Snapshot",
    "SparseUpdate",
    "TensorChange",
    "TensorEntry",
    "algo_of",
    "algos_of",
    "apply_patch",
    "compose_changes",
    "decode_patch",
    "diff_state",
    "encode_changes",
    "fetch_header",
    "header_length",
    "header_span",
    "interrupts_deferred",
    "load_anchor",
    "parse_header",
    "read_patch",
    "state_digest",
    "tensor_digest",
    "tensor_digests",
    "verify_digests",
    "write_anchor",
]
