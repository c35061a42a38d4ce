"""An asynchronous GRPO trainer whose weights reach the inference replicas only through a bucket.

Modules: `config` (typed TOML config), `grpo` (advantages and loss), `buffer` (versioned
rollout buffer with a staleness bound), `replicas` (HTTP client with failover), `rollout`
(episodes against the environment server), `train` (the async loop and publication through
sparsesync), `policy` (device, precision, loading, the published cast), `lora` (LoRA training),
`errors` (the trainer's errors), `metrics` (console, JSONL, trackio), `demo` (the one-command local run behind
`sparsesync demo`). TRL's trainers on sparsesync live in the library: `sparsesync.integrations.trl`.

    python -m trainer --config trainer.toml
"""
