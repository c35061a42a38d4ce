"""LoRA adapters below the protocol: everything about an adapter that needs no run.

- `meta`: `AdapterMeta`, what every commit of an adapter run says about its adapter (a plain
  dataclass; the protocol's `records` reads it from a commit and re-exports it).
- `config`: the bounds on an `adapter_config.json` (ranks, alphas, the regexes PEFT compiles),
  and the config's ranks checked against the adapter tensors.
- `bridge`: the PEFT bridge (PEFT models and adapter folders in and out, the base check, the
  engine's adapter layout).
- `state`: the writer side: what a publisher publishes for a PEFT model, an adapter state dict
  or an adapter folder, with its `AdapterMeta` (`adapter_state`, `meta_from_peft`,
  `peft_publish_state`, `meta_for_folder`).

Within the package: state over bridge over config and meta (contract "lora"). Nothing here imports
`sparsesync.protocol`, not even for annotations (import-linter contract "layers" in pyproject.toml, with
`exclude_type_checking_imports = false`): the protocol calls down into this package, and what
needs a run (a commit's adapter checked against the run's other commits) is
`sparsesync.protocol.adapter_runs`.
"""
