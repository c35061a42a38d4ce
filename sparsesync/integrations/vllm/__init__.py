"""Follow a sparsesync run with vLLM: the plugin, the weight-transfer backend, the apply, the check.

- `plugin.register()`: registers the `sparsesync` weight-transfer backend (also loaded by vLLM
  through the `vllm.general_plugins` entry point `sparsesync`).
- `backend.SparsesyncWeightTransferEngine`: runs in every vLLM worker; loads updates (CPU:
  layerwise reload of complete fused groups, tied LM head repacked; GPU: in-place checkpoint
  patches) and reads the weights back from what the forward pass reads (`readback.py`).
- `apply.WeightSync`: drives one `LLM` from version to version (staging in memory or under
  /dev/shm, finish in a `finally`, prefix cache reset on every switch).
- `layout.Layout`: checkpoint names -> vLLM layers (fused groups, experts, tied heads).

See docs/protocol.md ("What a replica serving version N guarantees"). Importing this package
imports no vLLM; the submodules `backend` and `readback` need it.
"""
