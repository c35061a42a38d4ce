"""LoRA adapters below the protocol: everything about an adapter that needs no run.

- `bridge`: the PEFT bridge (PEFT models and adapter folders in and out, the base check, the
  engine's adapter layout).
- `config`: the bounds on an `adapter_config.json` (ranks, alphas, the regexes PEFT compiles).

Nothing in this package imports `sparsesync.protocol` (import-linter contract "layers" in
pyproject.toml); what a commit's `adapter` field means to a run is
`sparsesync.protocol.adapter_runs`, which builds on this package.
"""
