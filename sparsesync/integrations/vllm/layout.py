"""Where each checkpoint tensor lives inside a vLLM model: its reload group and its location.

Checkpoint (Hugging Face) names are what runs carry. vLLM loads them into fewer, fused layers:
q/k/v into one `qkv_proj`, gate/up into `gate_up_proj`, every expert of a MoE layer into one
`w13_weight` [experts, 2 x intermediate, hidden] and one `w2_weight` [experts, hidden,
intermediate]. Guarantees:

- `group_key(name)` names the vLLM layer a checkpoint tensor loads into; the layerwise reload
  path allocates a layer afresh and expects every checkpoint tensor of it, so a reload sends
  whole groups (`complete_groups`), never a part of one.
- `locate(name, shapes)` says which parameter of which module holds the tensor, and which
  slice of it (fused rows, expert index), for reading it back (`readback.py`). Tensor
  parallelism: the location is the full tensor's; `readback.py` cuts the rank's shard.

Pure Python (no vLLM import): the app side groups and validates with it, the worker reads back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sparsesync.checkpoint import EXPERT_KEY

# fused vLLM modules -> the checkpoint modules they pack, in packing order (Llama/Qwen/Mistral
# family); the model's own `packed_modules_mapping` adds to it
DEFAULT_PACKED: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
# per-expert checkpoint names (EXPERT_KEY): gate/up go to w13 (gate rows first), down to w2
_EXPERT = EXPERT_KEY
_W13_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


@dataclass(frozen=True)
class Location:
    """One checkpoint tensor inside the vLLM model (full, unsharded coordinates)."""

    module: str  # vLLM module path (for experts: the MoE layer; its params may sit on a child)
    param: str  # parameter name on that module
    kind: str  # "plain" | "fused" (rows of a packed linear) | "expert_w13" | "expert_w2" | "vocab"
    expert: int | None = None
    part: int = 0  # index of the part in a fused module (q=0, k=1, v=2; gate=0, up=1)
    row0: int = 0  # first row in the fused weight (fused: sum of the earlier parts' rows)


class Layout:
    """The checkpoint key set of one model mapped onto vLLM's layers (see module docstring)."""

    def __init__(
        self, shapes: Mapping[str, tuple[int, ...]], packed: Mapping[str, Iterable[str]] | None = None
    ) -> None:
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        table = {k: list(v) for k, v in DEFAULT_PACKED.items()}
        for fused, parts in (packed or {}).items():
            table[fused] = list(parts)
        self._fused = {part: fused for fused, parts in table.items() for part in parts}
        self._parts = table
        self.groups: dict[str, list[str]] = {}
        for name in self.shapes:
            self.groups.setdefault(self.group_key(name), []).append(name)

    def group_key(self, name: str) -> str:
        """The vLLM layer `name` loads into."""
        m = _EXPERT.match(name)
        if m:
            return m["layer"]
        parts = name.split(".")[:-1]
        if parts and parts[-1] in self._fused:
            parts[-1] = self._fused[parts[-1]]
        return ".".join(parts)

    def complete_groups(self, names: Iterable[str]) -> list[str]:
        """Every checkpoint tensor of every layer `names` touch (what one reload must send)."""
        return sorted({m for n in names for m in self.groups[self.group_key(n)]})

    def locate(self, name: str) -> Location:
        m = _EXPERT.match(name)
        if m:
            proj = m["proj"]
            if proj in ("down_proj", "w2"):
                return Location(m["layer"], "w2_weight", "expert_w2", expert=int(m["e"]))
            return Location(m["layer"], "w13_weight", "expert_w13", expert=int(m["e"]), part=_W13_PART[proj])
        *mod, param = name.split(".")
        if mod and mod[-1] in self._fused:
            fused = self._fused[mod[-1]]
            siblings = self._parts[fused]
            idx = siblings.index(mod[-1])
            prefix = ".".join(mod[:-1])
            row0 = sum(
                self.shapes[f"{prefix}.{s}.{param}"][0]
                for s in siblings[:idx]
                if f"{prefix}.{s}.{param}" in self.shapes
            )
            return Location(f"{prefix}.{fused}", param, "fused", part=idx, row0=row0)
        module = ".".join(mod)
        if mod and mod[-1] in ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out"):
            return Location(module, param, "vocab")
        return Location(module, param, "plain")
