"""The embedded engine serving base + LoRA adapter (PEFT) for an adapter run (sparsesync.lora.bridge).

Guarantees (on top of `embedded.EmbeddedEngine`'s):
- The base weights loaded from `model_dir` are checked once, at start, against the run's base
  digest (`BaseModelMismatchError` on a mismatch); they are never written afterwards.
- The adapter config is bounded before PEFT allocates anything (`sparsesync.lora.bridge.adapter_layout`:
  numbers and regexes in bounds, the adapter no larger than the base): ConfigError otherwise.
- The engine's weights are the adapter's tensors under their PEFT names (what
  `adapter_model.safetensors` holds), each mapped onto the live LoRA parameter of the model's
  one adapter slot, in the run's dtype. Versions are written into those parameters in place
  under the engine's gate (no completion mixes two adapter versions) and read back bit for bit;
  every completion reports the adapter version that produced it.
- Before the first adapter version the engine serves the base model alone (LoRA B is zero at
  init) and reports weight_version None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference_space.engines.base import TensorSpec
from inference_space.engines.embedded import EmbeddedEngine, _LiveMap
from sparsesync.errors import EngineError
from sparsesync.lora.bridge import adapter_layout, adapter_tensors, attach_adapter, check_base
from sparsesync.lora.meta import AdapterMeta


class EmbeddedAdapterEngine(EmbeddedEngine):
    """Base model + the current adapter version of a LoRA run (see module docstring)."""

    name = "embedded-lora"

    def __init__(self, model_dir: str | Path, *, adapter: AdapterMeta, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        check_base(self._live.views(self.model), adapter, str(self.model_dir))
        adapter_layout(self.model_dir, adapter)  # the config bounded, on the meta device, before PEFT allocates it
        self.adapter = adapter
        self.model = attach_adapter(self.model, adapter).eval()
        views = adapter_tensors(self.model)  # PEFT names -> views of the live LoRA parameters
        live = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        if not views or any(v.untyped_storage().data_ptr() not in live for v in views.values()):
            raise EngineError(f"cannot map the adapter of {adapter.base_model!r} onto the model in {self.model_dir}",
                              hint="the adapter's target_modules do not match this model")
        self._live = _LiveMap(self.model, views)
        self._specs = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in views.items()}
        self._aliases = {}
        self.holds_device_state = False  # an adapter run keeps the mirror follower (the device path is untested there)
