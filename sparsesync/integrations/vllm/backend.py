"""The `sparsesync` weight-transfer backend for vLLM (runs inside each vLLM worker).

Registered from outside vLLM's tree (see `plugin.register`), so any vLLM entry point with
`weight_transfer_config={"backend": "sparsesync"}` (`LLM`, `AsyncLLM`, `vllm serve
--weight-transfer-config '{"backend": "sparsesync"}'`) accepts sparsesync updates through the
standard calls: `init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update(weight_version=...)`.

`init_info` carries the checkpoint layout (`shapes`: every checkpoint tensor's shape) so the
worker can locate each checkpoint tensor in its own layers (`layout.py`). An update
(`update_info`) names its payload instead of carrying it: `handle` is a key into this
process's staging table (single-process engines), or `path` is a safetensors file, written
under /dev/shm by `stage_file` (multi-process and tensor-parallel engines: tensors passed
through vLLM's RPC do not arrive; every worker reads the same file and its own weight loaders
cut its shard). Two kinds, both in checkpoint (HF) coordinates:

- "dense": full tensors of complete reload groups, loaded through vLLM's layerwise reload path
  (`initialize_layerwise_reload` -> `model.load_weights` -> `finalize_layerwise_reload`, the
  finalize in a `finally`), which handles CPU repacking of linear layers. Layers not sent keep
  their kernel tensors. Two gaps of that path on CPU are closed here: a tied LM head is
  repacked from the reloaded embedding (the head keeps a packed copy of the startup weights),
  and reloaded MoE experts are prepacked again (the path leaves them in checkpoint layout,
  which the CPU experts kernel misreads).
- "sparse": flat indices + values per tensor. Tensors held as the checkpoint holds them: the
  device apply, digests checked on the device (`device_sparse.py`); the others (shards, packed
  kernels) through `load_checkpoint_weight_patches`, GPU only (on CPU that loader fails inside
  the reload path). A failure of the second undoes the first.

Guarantee (the engine-side proof): after loading, unless `check` is off, the worker reads its
weights back in checkpoint coordinates from what the forward pass reads (`readback.py`):
dense: every element of every tensor sent, and the tied head against the embedding; sparse:
held tensors by digest on the device, the others every touched element and digest (host). A mismatch raises
`EngineCheckError`, so the caller never reports the version as served.

The rest of the state (a dense update's `verify`: the version's digest and dtype of every
checkpoint tensor not sent; single rank only, tensor parallel workers skip it): each tensor
the forward pass reads from a parameter (norms, embeddings, biases, experts, linears whose
kernel multiplies with the parameter) is read from the live model and its digest compared
with the version's, so an in-place edit or a replaced Parameter fails the update. A layer read
through a packed CPU kernel (oneDNN, sgl: a copy the parameter no longer reaches) is not
probed again: its module and kernel object must be the very ones the last passing read-back of
that layer verified (identity, not bytes: a rewrite inside the packed copy itself is not seen);
a layer not verified so since the engine started fails the check, which a full load clears.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from sparsesync.errors import EngineCheckError
from sparsesync.integrations.vllm import device_sparse, readback, unchanged
from sparsesync.integrations.vllm.layout import Layout, Location
from sparsesync.protocol.follower.mirror import pager, release_freed_memory

BACKEND = "sparsesync"

# -- staging: in this process (single-process engines) or in a file (every worker reads it) --
_STAGED: dict[str, dict[str, Any]] = {}
_STAGED_LOCK = threading.Lock()
_COUNTER = itertools.count()


def stage(payload: dict[str, Any]) -> str:
    """Keep `payload` for the worker in this process; returns its handle."""
    handle = f"sparsesync-{next(_COUNTER)}"
    with _STAGED_LOCK:
        _STAGED[handle] = payload
    return handle


def unstage(handle: str) -> None:
    with _STAGED_LOCK:
        _STAGED.pop(handle, None)


def stage_file(kind: str, payload: dict[str, Any], directory: str | None = None) -> str:
    """Write `payload` as one safetensors file (under /dev/shm when it exists); returns its path.

    dense: name -> tensor. sparse: `name.indices` / `name.values`, with the full shapes and the
    target digests as JSON in the metadata keys "shapes" and "digests".
    """
    from safetensors.torch import save_file

    directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix="sparsesync-update-", suffix=".safetensors", dir=directory)
    os.close(fd)
    if kind == "dense":
        flat = {n: t.contiguous() for n, t in payload["tensors"].items()}
        meta = {"verify": json.dumps(payload["verify"])} if payload.get("verify") else {}
    else:
        flat = {}
        for n, (idx, val) in payload["updates"].items():
            flat[f"{n}.indices"], flat[f"{n}.values"] = idx.contiguous(), val.contiguous()
        meta = {k: json.dumps(payload.get(k, {})) for k in ("shapes", "digests", "base_digests")}
    save_file(flat, path, metadata=meta)
    return path


def _take(handle: str) -> dict[str, Any]:
    with _STAGED_LOCK:
        payload = _STAGED.get(handle)
    if payload is None:
        raise ValueError(
            f"sparsesync update handle '{handle}' is not staged in this process "
            "(multi-process engines must pass `path` instead)"
        )
    return payload


@dataclass
class SparsesyncInitInfo(WeightTransferInitInfo):
    """The checkpoint layout the worker maps updates onto."""

    run_url: str = ""  # for logs only: the run the replica follows
    shapes: dict[str, list[int]] = field(default_factory=dict)  # checkpoint name -> shape (every tensor)
    check: bool = True  # read the weights back after each update (the engine-side proof)


@dataclass
class SparsesyncUpdateInfo(WeightTransferUpdateInfo):
    """One update: where its tensors are, and their kind."""

    kind: str  # "dense" | "sparse"
    handle: str | None = None  # staging-table key (same process)
    path: str | None = None  # safetensors file written by `stage_file`

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "sparse"):
            raise ValueError(f"sparsesync update kind '{self.kind}': expected 'dense' or 'sparse'")
        if (self.handle is None) == (self.path is None):
            raise ValueError("sparsesync update: give exactly one of `handle` or `path`")


def _load_payload(info: SparsesyncUpdateInfo) -> dict[str, Any]:
    if info.handle is not None:
        return _take(info.handle)
    from safetensors import safe_open
    from safetensors.torch import load_file

    flat = load_file(str(info.path))
    with safe_open(str(info.path), framework="pt") as f:
        meta = f.metadata() or {}
    if info.kind == "dense":
        return {"tensors": flat, "verify": json.loads(meta.get("verify", "{}"))}
    names = sorted({k.rsplit(".", 1)[0] for k in flat})
    return {
        "updates": {n: (flat[f"{n}.indices"], flat[f"{n}.values"]) for n in names},
        "shapes": json.loads(meta.get("shapes", "{}")),
        "digests": json.loads(meta.get("digests", "{}")),
        "base_digests": json.loads(meta.get("base_digests", "{}")),
    }


_LAYER = re.compile(r"^(.*?\.layers\.[0-9]+)\.")


def _layer_by_layer(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` for `model.load_weights`, each decoder layer's together (vLLM's layerwise reload
    processes a module once all of its weights arrived), handing the memory glibc keeps from the
    last layer's reload temporaries (materialized module, CPU repacking) back to the OS before the
    next layer starts: without it they piled up over the whole model (0.9 copies of a 96 MB model
    during a full reload, all of it returned by the trim afterwards). A layer's tensors that lie
    in the follower's mirror leave this process's RSS once the next layer starts (`mirror.pager`)."""
    def key(name: str) -> str:
        m = _LAYER.match(name)
        return m.group(1) if m else ""

    drop = pager(tensors.values())
    last: str | None = None
    sent: list[torch.Tensor] = []
    for name in sorted(tensors, key=lambda n: (key(n), n)):
        layer = key(name)
        if last is not None and layer != last:
            release_freed_memory()
            for t in sent:
                drop(t)
            sent.clear()
        last = layer
        sent.append(tensors[name])
        yield name, tensors[name]


def _tied_heads(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(LM head module, checkpoint name of the embedding it ties to) for each tied head."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeds = {
        id(m.weight): n
        for n, m in model.named_modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead) and hasattr(m, "weight")
    }
    return [
        (m, embeds[id(m.weight)] + ".weight")
        for m in model.modules()
        if isinstance(m, ParallelLMHead) and id(getattr(m, "weight", None)) in embeds
    ]


def _prepack_reloaded_experts(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put reloaded CPU MoE experts back into the kernel's prepacked layout.

    vLLM 0.32's layerwise reload leaves `w13_weight`/`w2_weight` of a reloaded MoE layer in the
    checkpoint layout while the CPU experts kernel reads the prepacked one (outputs change
    even for identical weights). A layer whose parameters equal the plain layout of what was
    sent is prepacked in place with vLLM's own op; anything else is left to the read-back."""
    from sparsesync.checkpoint import EXPERT_KEY

    layers: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = EXPERT_KEY.match(name)
        if m:
            layers.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[m["proj"]] = t
    for layer_name, experts in layers.items():
        try:
            mod = readback.module_of(model, Location(layer_name, "w13_weight", "expert_w13"))
        except KeyError:
            continue
        impl = readback.cpu_experts(mod)
        if impl is None or sorted(experts) != list(range(mod.w13_weight.shape[0])):
            continue
        try:
            w13 = torch.stack(
                [
                    torch.cat([_proj(experts[e], "gate_proj", "w1"), _proj(experts[e], "up_proj", "w3")])
                    for e in sorted(experts)
                ]
            )
            w2 = torch.stack([_proj(experts[e], "down_proj", "w2") for e in sorted(experts)])
        except (KeyError, TypeError, RuntimeError):
            continue
        for param, plain in ((mod.w13_weight, w13), (mod.w2_weight, w2)):
            if param.shape == plain.shape and torch.equal(param.detach().cpu(), plain.to(param.dtype)):
                packed = torch.empty_like(param.data)
                torch.ops._C.prepack_moe_weight(param.data.contiguous(), packed, impl.isa)
                param.data.copy_(packed)


def _proj(expert: dict[str, torch.Tensor], *names: str) -> torch.Tensor:
    """An expert's projection under the first of its names it has (KeyError: none)."""
    for name in names:
        if name in expert:
            return expert[name]
    raise KeyError(names[0])


def _repack(head: readback.Layer) -> None:
    """Re-run the head's weight processing from its (tied, reloaded) weight: on CPU the logits
    kernel holds a packed copy made at startup, which vLLM's reload path does not refresh."""
    head.quant_method.process_weights_after_loading(head)


class SparsesyncWeightTransferEngine(WeightTransferEngine[SparsesyncInitInfo, SparsesyncUpdateInfo]):
    """Applies sparsesync updates to the worker's model (see module docstring)."""

    init_info_cls = SparsesyncInitInfo
    update_info_cls = SparsesyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: WeightTransferConfig, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.run_url = ""
        self.updates_applied = 0
        self.layout: Layout | None = None
        self.check_enabled = True
        self.last_checked = 0  # tensors read back by the last update
        # module -> (module, packed kernel) last read back and passed
        self.kernels: dict[str, tuple[torch.nn.Module, Any]] = {}

    def init_transfer_engine(self, init_info: SparsesyncInitInfo) -> None:
        self.run_url = init_info.run_url
        self.check_enabled = bool(init_info.check)
        packed = dict(getattr(self.model, "packed_modules_mapping", {}) or {})
        self.layout = Layout({k: tuple(v) for k, v in init_info.shapes.items()}, packed) if init_info.shapes else None

    def start_weight_update(self) -> None:
        """No-op: each `update_weights` call runs its own complete load (see receive_weights)."""

    def finish_weight_update(self) -> None:
        """No-op: the layerwise reload was finalized inside `receive_weights`."""

    def receive_weights(self, update_info: SparsesyncUpdateInfo) -> None:
        payload = _load_payload(update_info)
        if update_info.kind == "dense":
            self._load_dense(payload["tensors"], payload.get("verify") or {})
        else:
            self._load_sparse(payload["updates"], payload.get("shapes", {}), payload.get("digests", {}),
                              payload.get("base_digests", {}))
        self.updates_applied += 1

    def _tp(self) -> tuple[int, int]:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def _load_dense(self, tensors: dict[str, torch.Tensor], verify: dict[str, Any]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model: readback.Layer = self.model
        initialize_layerwise_reload(model)
        try:
            model.load_weights(_layer_by_layer(tensors))
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
            release_freed_memory()
        _prepack_reloaded_experts(self.model, tensors)
        heads = [(h, e) for h, e in _tied_heads(self.model) if e in tensors]
        for head, _ in heads:
            _repack(head)
        if self.check_enabled:
            rank, size = self._tp()
            layout = self._layout(tensors)
            problems = readback.check(self.model, layout, tensors, rank=rank, size=size)
            for _, emb in heads:
                problems += readback.check_tied_head(self.model, tensors[emb], rank=rank, size=size)
            if size == 1:
                problems += unchanged.check(self.model, layout, verify, self.kernels)
            self._raise(problems, len(tensors) + len(verify))
            for name in tensors:  # each packed kernel just read back and passed: its identity from now on
                unchanged.remember(self.model, layout.locate(name), self.kernels)
            for head, _ in heads:
                unchanged.remember_module(head, "lm_head", self.kernels)

    def _load_sparse(
        self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], shapes: dict[str, Any], digests: dict[str, str],
        base_digests: dict[str, str],
    ) -> None:
        """Tensors held as the checkpoint holds them: the device apply, digests checked on the device
        (`device_sparse`); the others through vLLM's loaders; all or nothing between the two."""
        rank, size = self._tp()
        layout = self.layout or Layout({n: tuple(s) for n, s in shapes.items()})
        held = device_sparse.held_views(self.model, layout, updates, shapes, digests) if size == 1 else {}
        for head, emb in _tied_heads(self.model):  # a head packed apart from its embedding: vLLM's loaders
            if emb in held and readback.through_kernel(head, Location("lm_head", "weight", "vocab")):
                del held[emb]
        rest = {n: u for n, u in updates.items() if n not in held}
        if rest and self.device.type == "cpu":
            raise RuntimeError(f"sparse in-place patches of layers vLLM packs ({', '.join(sorted(rest)[:3])}) are "
                               "GPU-only in vLLM 0.32 (CPU: send kind='dense')")
        done = device_sparse.write_held(held, updates, base_digests, digests) if held else None  # checked, or undone
        try:
            problems = self._load_loader_patches(rest, shapes, digests)
            for head, emb in _tied_heads(self.model) if self.check_enabled and size == 1 else []:
                if emb in updates:  # the head's kernel against the embedding as held
                    loc = Location(emb.rsplit(".", 1)[0], "weight", "vocab")
                    embed = readback.as_read(readback.module_of(self.model, loc), loc)[: tuple(shapes[emb])[0]]
                    problems += readback.check_tied_head(self.model, embed)
            self._raise(problems, len(updates))
        except BaseException:
            if done is not None:
                done.undo()
            raise

    def _load_loader_patches(
        self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], shapes: dict[str, Any], digests: dict[str, str]
    ) -> list[str]:
        """The sparse tensors not held as the checkpoint holds them: vLLM's weight loaders; the
        read-back's problems (`check`)."""
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        if not updates:
            return []
        patches = []
        for name, (indices, values) in updates.items():
            patches.append(
                CheckpointWeightPatch(
                    name=name,
                    shape=tuple(shapes[name]),
                    dtype=values.dtype,
                    values=values.to(self.device, non_blocking=True),
                    indices=indices.to(self.device, non_blocking=True),
                )
            )
        load_checkpoint_weight_patches(self.model, patches)
        return self._check_sparse(updates, shapes, digests) if self.check_enabled else []

    def _check_sparse(
        self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], shapes: dict[str, Any], digests: dict[str, str]
    ) -> list[str]:
        """Touched elements (every rank, its shard) and, on a single rank, each touched tensor's digest."""
        from sparsesync.codec import algo_of, tensor_digest

        rank, size = self._tp()
        layout = self.layout or Layout({n: tuple(s) for n, s in shapes.items()})
        problems = []
        for name, (idx, val) in updates.items():
            shape = tuple(shapes[name])
            full = torch.zeros(shape, dtype=val.dtype)  # expected at the touched elements only
            full.view(-1)[idx.cpu()] = val.cpu()
            mask = torch.zeros(shape, dtype=torch.bool)
            mask.view(-1)[idx.cpu()] = True
            loc = layout.locate(name)
            try:
                got, exp = readback.local_pair(self.model, loc, full, rank, size)
                _, m = readback.local_pair(self.model, loc, mask, rank, size)
            except (KeyError, RuntimeError, IndexError) as e:
                problems.append(f"tensor '{name}': cannot read it back ({e})")
                continue
            got = got.cpu()
            want = readback.same_width(got, exp)
            if got.dtype != want.dtype or bool((readback.bits(got) != readback.bits(want))[m].any()):
                problems.append(f"tensor '{name}': touched elements differ from the version")
            elif (
                size == 1
                and name in digests
                and tensor_digest(got.contiguous(), algo_of(digests[name])) != digests[name]
            ):
                problems.append(f"tensor '{name}': digest of the engine's copy differs from the version's")
        return problems

    def _layout(self, tensors: dict[str, torch.Tensor]) -> Layout:
        if self.layout is not None:
            return self.layout
        return Layout(
            {n: tuple(t.shape) for n, t in tensors.items()},
            dict(getattr(self.model, "packed_modules_mapping", {}) or {}),
        )

    def _raise(self, problems: list[str], n: int) -> None:
        self.last_checked = n
        if problems:
            raise EngineCheckError(
                f"vLLM worker computes with weights that differ from the update ({len(problems)} of {n} tensors): "
                + "; ".join(problems[:5]),
                hint="the update did not reach the forward pass; reload the version",
            )

    def shutdown(self) -> None:
        pass
