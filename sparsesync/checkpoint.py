"""Plain safetensors checkpoints on local disk: one file, or a folder of shards.

`load_checkpoint` reads every tensor of a `.safetensors` file or of all `*.safetensors` files
in a folder (a saved Hugging Face checkpoint); duplicate names across shards are an error,
never silently overwritten. Nothing here unpickles anything.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from sparsesync.errors import ConfigError, PatchFormatError


def checkpoint_files(source: Path) -> list[Path]:
    """The safetensors files that make up `source` (a file or a folder), sorted."""
    source = Path(source)
    if source.is_file():
        return [source]
    if source.is_dir():
        files = sorted(source.glob("*.safetensors"))
        if files:
            return files
        raise ConfigError(f"no *.safetensors files in folder {source}", hint="point at a saved checkpoint folder")
    raise ConfigError(f"{source} does not exist", hint="give a .safetensors file or a folder of shards")


def load_checkpoint(source: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `source`, on CPU."""
    state: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(source):
        try:
            part = load_file(f)
        except (SafetensorError, OSError) as e:
            raise PatchFormatError(f"{f} is not a readable safetensors file: {e}") from e
        dup = state.keys() & part.keys()
        if dup:
            raise ConfigError(f"tensor {sorted(dup)[0]!r} appears in more than one shard of {source}")
        state.update(part)
    return state
