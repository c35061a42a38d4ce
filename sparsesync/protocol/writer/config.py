"""The publisher's options, checked before anything is read or written.

Guarantees: `PublisherConfig.validate` raises ConfigError (with the accepted values) for every
option out of range, so a bad option never leaves a half-claimed run behind. The parts read
the config object live (a change of `anchor_every` after start applies from the next version).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from sparsesync.codec import Effort
from sparsesync.codec.patch import check_effort
from sparsesync.errors import ConfigError
from sparsesync.protocol.writer.parts import DEFAULT_PART_BYTES

# where a publisher's snapshot lives: "auto" (None): CPU weights as "cpu"; GPU weights "device" when
# the model fits twice in the GPU's free memory, else "host". "cpu": the host copy diffed and encoded
# by the C codec in `publish`; "device": on the weights' device, "host": in (pinned) host memory,
# both with changes extracted on the weights' device and entropy coding in the background
# (`codec.device_snapshot`)
SNAPSHOT_PLACES = ("auto", "cpu", "device", "host")


@dataclass
class PublisherConfig:
    """How often anchors are written and how much may wait for upload (see `Publisher` for each option)."""

    anchor_every: int = 50  # versions between periodic anchors (0: only the first one)
    anchor_fraction: float = 0.5  # anchor when delta bytes since the last anchor exceed this x anchor bytes
    queue_size: int = 4  # versions waiting for upload before deltas are coalesced
    retry_backoff_s: float = 0.5  # first wait after a failed upload (doubles, max 30 s)
    writer: str = ""  # writer id recorded in claims and commits; default host-pid-random
    part_bytes: int = DEFAULT_PART_BYTES  # tensor bytes per part of a version (0: one delta file, format 1)
    dist_timeout_s: float = 300.0  # distributed publisher: how long ranks wait for each other's parts
    # the published dtype of floating tensors, cast one tensor at a time (None: as given)
    dtype: torch.dtype | None = None
    # "size": smallest patches; "speed": 26-29% larger at 1.6% density, encode and decode faster
    # (`sparsesync.codec.Effort`)
    effort: Effort = "size"
    # where the snapshot of weights on a GPU lives (`SNAPSHOT_PLACES`; None: picked, `whole.snapshot_place`)
    snapshot: str | None = None

    def validate(self) -> None:
        """Raise ConfigError naming the first option out of range."""
        if self.anchor_every < 0:
            raise ConfigError(f"anchor_every={self.anchor_every}: must be >= 0")
        if not 0 < self.anchor_fraction:
            raise ConfigError(f"anchor_fraction={self.anchor_fraction}: must be > 0")
        if self.queue_size < 1:
            raise ConfigError(f"queue_size={self.queue_size}: must be >= 1")
        if self.part_bytes < 0:
            raise ConfigError(f"part_bytes={self.part_bytes}: must be >= 0 (0: one delta file per version)")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ConfigError(f"dtype={self.dtype!r}: must be a floating torch.dtype or None",
                              hint="e.g. dtype=torch.bfloat16 to publish an fp32 master as bf16")
        try:
            check_effort(self.effort)
        except ValueError as e:
            raise ConfigError(
                str(e), hint="'size' (smallest patches) or 'speed' (faster encode and decode, larger patches)"
            ) from None
        if self.snapshot not in (None, *SNAPSHOT_PLACES):
            raise ConfigError(f"snapshot={self.snapshot!r}: must be one of {', '.join(SNAPSHOT_PLACES)} or None",
                              hint="None or 'auto': on the GPU when the model fits twice, else pinned host memory")

    def writer_id(self) -> str:
        """`writer`, or host-pid-random: unique even for two publishers in one process (it breaks
        epoch ties, see `CommitWriter.check_fence`)."""
        return self.writer or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}".replace("_", "-")


SERVED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def served_dtype(config_json: bytes | None, state: Mapping[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype a publisher with no `dtype=` publishes `state`'s floating tensors in: the
    16-bit dtype the checkpoint's config.json declares (`dtype`, or `torch_dtype`), which
    replicas started from that checkpoint serve, when every floating tensor of `state` is fp32
    (an fp32 master); None (as given) otherwise: no config.json, another declared dtype, a
    state already 16-bit or mixed."""
    if not config_json:
        return None
    try:
        cfg = json.loads(config_json)
    except ValueError:
        return None
    declared = cfg.get("dtype") or cfg.get("torch_dtype") if isinstance(cfg, dict) else None
    want = SERVED_DTYPES.get(str(declared).removeprefix("torch."))
    floating = {t.dtype for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return want if want is not None and floating == {torch.float32} else None
