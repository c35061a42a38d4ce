"""Engine integrations: what any user of an inference engine needs to follow a sparsesync run.

`sparsesync.integrations.vllm`: the vLLM plugin, weight-transfer backend, apply and engine-side
check. `sparsesync.integrations.trl`: TRL's trainers publishing through sparsesync
(`SparsesyncCallback`, `SparsesyncWeightTransfer`; needs `transformers`). Importing this
package imports no engine and no trainer library.
"""
