"""The vLLM engine serving base + LoRA adapter for an adapter run (sparsesync.lora.bridge).

vLLM is started with LoRA enabled on the base model folder; the base's weights are checked
once, at start, against the run's base digest (`BaseModelMismatchError`) and never written; the
adapter config is bounded before vLLM starts (`sparsesync.lora.bridge.adapter_layout`).
Each adapter version goes into a new adapter slot: the verified adapter is written as a PEFT
folder, registered with vLLM under a fresh integer id (`LoRARequest`), and every request from
then on names that slot; the previous slot is removed once its requests have finished. Under
the engine's gate no request is running while slots change, so no completion mixes two adapter
versions, and each reports the version of the slot it ran on. vLLM computes the adapter in its
`lora_dtype` (the model's dtype, bf16 for the tiny model): an adapter run in float32 is served
rounded to it.

What is checked on the engine side: the folder vLLM loads is read back and compared bit for
bit with the version before vLLM sees it, and vLLM must register the slot (`add_lora` true);
the slot's weights inside vLLM are not read back. Instead the tests compare a replica's
generations, after it followed a run, with a fresh vLLM engine loaded with the same adapter as
PEFT saves it (`test_vllm_lora_slot_generates_like_a_fresh_engine_with_the_same_adapter`:
equal token ids, logprobs within 1e-3).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from inference_space.engines.base import TensorSpec
from inference_space.engines.vllm_engine import VllmEngine
from sparsesync.checkpoint import load_checkpoint
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import EngineCheckError, EngineError
from sparsesync.lora.bridge import adapter_layout, check_base, write_adapter_folder
from sparsesync.lora.meta import AdapterMeta

_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


class VllmAdapterEngine(VllmEngine):
    """vLLM with LoRA: base + the current adapter version of a run (see module docstring)."""

    name = "vllm-lora"

    def __init__(self, model_dir: str | Path, *, adapter: AdapterMeta, **kwargs: Any) -> None:
        check_base(load_checkpoint(Path(model_dir)), adapter, str(model_dir))  # before vLLM starts
        layout = adapter_layout(Path(model_dir), adapter)  # the config bounded before vLLM or PEFT allocate it
        max_rank = next((r for r in _RANKS if r >= adapter.rank), None)
        if max_rank is None:
            raise EngineError(f"adapter rank {adapter.rank} is above vLLM's largest LoRA rank {_RANKS[-1]}")
        super().__init__(model_dir, enable_lora=True, max_lora_rank=max_rank, max_loras=2, **kwargs)
        self.adapter = adapter
        self._specs = {k: TensorSpec(shape, dtype) for k, (shape, dtype) in layout.items()}
        self._aliases = {}
        self._adapter_state: dict[str, torch.Tensor] = {}
        self._slots = Path(tempfile.mkdtemp(prefix="sparsesync-lora-"))
        self._next_id = 1

    def _load_full(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self._swap(version, {k: v.detach().clone() for k, v in tensors.items()})

    def _apply_sparse(
        self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]
    ) -> None:
        self._swap(version, {**self._adapter_state, **{k: v.detach().clone() for k, v in full.items()}})

    def _swap(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Runs under the gate: register `state` as a new slot, make it the served one, drop the old."""
        from vllm.lora.request import LoRARequest

        lora_id, self._next_id = self._next_id, self._next_id + 1
        folder = self._slots / f"v{version}-{lora_id}"
        write_adapter_folder(state, self.adapter, folder, version=version, digest="")
        back = load_checkpoint(folder / "adapter_model.safetensors")
        bad = self._mismatches(back, state) + sorted(set(back) ^ set(state))
        if bad:
            raise EngineCheckError(
                f"vllm-lora: adapter slot {folder} differs from version {version}: {', '.join(bad[:5])}"
            )
        request = LoRARequest(f"sparsesync-v{version}-{lora_id}", lora_id, str(folder))
        if not self.llm.llm_engine.add_lora(request):
            raise EngineCheckError(f"vLLM did not register adapter slot {lora_id} for version {version}")
        old, self._lora_request, self._adapter_state = self._lora_request, request, state
        self.last_sent = sorted(state)
        if old is not None:  # no request runs under the gate: the old slot is idle
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._adapter_state.items()}

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._slots, ignore_errors=True)
