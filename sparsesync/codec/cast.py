"""A state dict seen in another dtype, one tensor at a time (no whole-state cast).

Guarantee: `CastState(state, dtype)[name]` is exactly `state[name].to(dtype)` (the same bits as
casting the whole state first: the cast is elementwise), made when the tensor is read and dropped
by the reader; tensors already in `dtype` are returned as they are (no copy). `layout(name)` says
what the cast tensor would be (device, dtype, shape, contiguity) without casting it. Memory: at
most the tensors a reader holds at once; the snapshot's fused diff reads the caller's tensor
(`uncast`) and casts it in slices of `diff.CAST_SLICE` elements, so it holds a few slices.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from sparsesync.errors import ConfigError


class CastState(Mapping[str, torch.Tensor]):
    """`state` read in floating `dtype` (see the module docstring)."""

    def __init__(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ConfigError(f"dtype={dtype} is not a floating dtype", hint="pass e.g. dtype=torch.bfloat16")
        self.source, self.dtype = state, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.source[name]
        return t.to(self.dtype) if t.dtype.is_floating_point else t  # integer buffers stay as they are

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def layout(self, name: str) -> tuple[torch.device, torch.dtype, torch.Size, bool]:
        """(device, dtype, shape, contiguous) of `self[name]`, without casting it."""
        t = self.source[name]
        dt = self.dtype if t.dtype.is_floating_point else t.dtype
        return t.device, dt, t.shape, t.is_contiguous()  # the cast keeps a dense tensor's strides

    def sub(self, names: list[str]) -> CastState:
        """The cast view of `names` only."""
        return CastState({n: self.source[n] for n in names}, self.dtype)


def uncast(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """`state[name]` as the caller gave it (of a `CastState`: before the cast; a reader that casts
    slice by slice, `diff.diff_cpu_tensor`, takes this)."""
    return state.source[name] if isinstance(state, CastState) else state[name]


def owned_copy(state: Mapping[str, torch.Tensor], name: str, device: torch.device) -> torch.Tensor:
    """A contiguous copy of `state[name]` on `device` that shares no memory with the caller's
    tensor (of a `CastState`: the cast itself, not a second copy of it)."""
    t = state[name].detach()
    if isinstance(state, CastState) and t.dtype != state.source[name].dtype:
        return t.to(device).contiguous()  # the cast made a fresh tensor
    return t.to(device, copy=True).contiguous()


def layout(state: Mapping[str, torch.Tensor], name: str) -> tuple[torch.device, torch.dtype, torch.Size, bool]:
    """(device, dtype, shape, contiguous) of `state[name]`, reading a `CastState` without casting."""
    if isinstance(state, CastState):
        return state.layout(name)
    t = state[name]
    return t.device, t.dtype, t.shape, t.is_contiguous()


def nbytes_of(state: Mapping[str, torch.Tensor], name: str) -> int:
    """Bytes of `state[name]` (of a `CastState`: after the cast, without casting)."""
    _, dtype, shape, _ = layout(state, name)
    return shape.numel() * dtype.itemsize


def state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    """Tensor bytes of `state` (of a `CastState`: after the cast, without casting)."""
    return sum(nbytes_of(state, n) for n in state)


def select(state: Mapping[str, torch.Tensor], names: list[str]) -> Mapping[str, torch.Tensor]:
    """`state` restricted to `names` (a `CastState` stays one: nothing is cast here)."""
    if isinstance(state, CastState):
        return state.sub(names)
    return {n: state[n] for n in names}
