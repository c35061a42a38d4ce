"""Engine integrations: what any user of an inference engine needs to follow a sparsesync run.

`sparsesync.integrations.vllm`: the vLLM plugin, weight-transfer backend, apply and engine-side
check. `sparsesync.integrations.trl`: TRL's trainers publishing through sparsesync
(`SparsesyncCallback`, `SparsesyncWeightTransfer`; needs `transformers`);
`sparsesync.integrations.trl_client`: a drop-in for TRL's vLLM client in `GRPOTrainer` server
mode (`sparsesync_server_mode`); `sparsesync.integrations.trl_rollout`: TRL's async GRPO rollout
worker on sparsesync replicas (`follow_replicas`; both need `trl`). Importing this
package imports no engine and no trainer library.
"""
